// Per-token path in two launches (what the fused one-launch path of lora_fused.cu does not take: more than 64
// tokens, slices too large for its shared memory, GPUs without thread-block clusters, KernelConfig(fused=False)):
// bound by latency and bytes, not arithmetic, so fp32 FMAs on CUDA cores. Work is cut into the chunks of chunks.cuh;
// with every token its own adapter, each chunk is one token.
// Every block moves up to 64 rank rows x 512 bytes = 32 KB of factors: small ranks take a group of 2 or 4 K slices
// (shrink) or column chunks (expand) of 32 lanes x 16 bytes per block. The grid is sized for the call's max_rank;
// each block picks its group by its own chunk's rank (group_for), so a rank-8 chunk in a call of max_rank 64 takes
// a quarter of the grid's blocks, each moving four slices, and the rest of its blocks exit after the lookup.
//   shrink: grid (positions, K slices / group); the block's 64 (row, slice) pieces of A and the chunk's x slices go to
//           shared memory by cp.async; warp w dots its 8 pieces with two tokens at a time, one warp_sum_8 per
//           token; one fp32 partial per (slice, position, row).
//   expand: grid (positions, column chunks / group); the chunk's Bt columns and y rows go to shared memory by
//           cp.async, v = sum of the slice partials; warps then own (token, column chunk) items, each lane a
//           16-byte run of outputs, looping over the rank rows (from rank 32, a chunk with few items shares each
//           one's rows among several warps).
// "positions" is a block per sorted position, or for a split call's short runs two waves of blocks that walk the
// list of their chunk starts (walk_positions).
// The expand is launched as a programmatic dependent of the shrink: its chunk lookup, Bt and y loads overlap
// the shrink, and it waits for the shrink grid only before reading the partials.
// A grouped call (G outputs sharing x) adds a grid dimension: block z works on output z, with row z of the tables
// and its own partials; the expand's grid covers the widest output, and blocks past a narrower one exit at once.
// A call that writes y instead of adding to it (accumulate = 0) has the shrink's blocks zero y first (the blocks
// of position p share row p) and the expand write without reading y: no separate fill kernel.
#include <algorithm>

#include "chunks.cuh"

namespace punica {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = 8;      // shrink: pieces of A one warp dots with a token (one warp_sum_8)
constexpr int kPieces = kWarps * kRowsPerWarp;  // shrink: (row, K slice) pieces of A per block and pass
constexpr int kTileRanks = 64;       // expand: rank rows of Bt staged in shared memory at a time
constexpr int kBlockRows = 64;       // rank rows a block moves at most (group_for): a group of g holds ranks <= 64 / g
static_assert(kBlockRows / 2 <= kTileRanks, "a chunk of a group of 2 or more fits one Bt tile");
static_assert(kChunk % 4 == 0, "the expand's v (kChunk x max_rank floats) ends on a 16-byte boundary");
constexpr int kItemsPerWarp = 2;     // expand: (token, column chunk) items a warp owns (chunks of 8 items or more)
constexpr int kMaxGroup = 4;         // most K slices / column chunks one block takes
static_assert(kChunk * kMaxGroup <= kWarps * kItemsPerWarp, "the expand serves a chunk's items in one pass");
constexpr int kSumBatch = 16;        // expand: slice partials a thread loads at once
constexpr int kSplitMinRank = 32;    // expand: smallest rank whose rows several warps share (below)

// K slices (shrink) or column chunks (expand) of 32 x 16 bytes a block takes for an adapter of rank `rank`:
// kBlockRows / (the rank rounded up to a power of two), at most kMaxGroup and `available` (the call's slices, or
// the output's column chunks), so every block moves up to 64 rank rows x 512 bytes = 32 KB of factors; a power of
// two dividing kWarps. Never larger for a larger rank: the grid, sized by group_for(max_rank), covers every chunk's.
// A group of 2 or more holds ranks up to kBlockRows / group.
__host__ __device__ constexpr int group_for(int rank, int available) {
  int rows = 8;
  while (rows < rank && rows < kBlockRows) rows *= 2;
  int group = kBlockRows / rows < kMaxGroup ? kBlockRows / rows : kMaxGroup;
  while (group > 1 && group > available) group /= 2;
  return group;
}

// A 16-byte shared-memory load ptxas may not hoist out of a loop (a volatile PTX load; an asm volatile plain load
// was still hoisted): re-reading the A pieces for every pair of tokens keeps 8 x 8 widened floats out of the
// registers (hoisted, they cost half the blocks per multiprocessor, or spills under a register cap).
__device__ __forceinline__ uint4 load_shared_16(const uint4* ptr) {
  uint4 v;
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(ptr));
  asm volatile("ld.volatile.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address));
  return v;
}

// Runs serve(position) for each sorted position this block serves, with a barrier after each (the block's shared
// memory is reused for the next). Without a list (positions null) block x serves position x. With one (chunk starts
// ascending, then num_tokens), block x serves entries x, x + gridDim.x, ... up to the first value outside [0, T).
template <typename Serve>
__device__ __forceinline__ void walk_positions(const int32_t* __restrict__ positions, int num_tokens, Serve serve) {
  for (int entry = blockIdx.x; entry < num_tokens; entry += gridDim.x) {
    const int position = positions == nullptr ? entry : positions[entry];
    if (position < 0 || position >= num_tokens) return;  // past the list's positions
    serve(position);
    __syncthreads();
  }
}

// v_partial [G, num_slices, T, max_rank] fp32: entry (g, slice, p, r) = A_s[r, slice] . x[token(p), slice] with
// output g's A, for the positions p of every chunk and r < its rank; nothing else is written. The block takes
// kGroup consecutive K slices (1, 2 or 4) and kPieces (row, slice) pieces of A per pass: piece q = w + 8 i belongs
// to warp w, slice w % group, row w / group + (8 / group) i. Pieces and x go to shared memory by cp.async (no
// registers held while loads fly, so more blocks fit). Dynamic shared memory: A [kPieces][32], x [kChunk][group][32]
// (16 B each). This is the work for `chunk` (looked up, size > 0), which starts at sorted position `position`.
template <typename T, int kGroup>
__device__ __forceinline__ void shrink_at(const T* __restrict__ x, const T* __restrict__ pool,
                                          float* __restrict__ v_partial, int num_tokens, int hidden_in, int max_rank,
                                          int num_slices, int position, const Chunk& chunk) {
  constexpr int kVec = Vec<T>::kSize;
  extern __shared__ uint4 smem_vectors[];
  uint4* a_shared = smem_vectors;
  uint4* x_shared = smem_vectors + kPieces * 32;
  const int first_slice = blockIdx.y * kGroup;
  if (first_slice >= num_slices) return;  // a chunk of small rank needs fewer blocks than the grid has
  const int size = chunk.size;
  const int rank = chunk.rank;
  const T* lora_a = pool + chunk.a_offset;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int slice = first_slice + warp % kGroup;
  const int row_stride = kWarps / kGroup;
  const int rows_per_pass = kPieces / kGroup;

  auto load_pieces = [&](int row0) {  // zero past the rank or H_in
#pragma unroll 1
    for (int e = threadIdx.x; e < kPieces * 32; e += kThreads) {
      const int q = e / 32;
      const int row = row0 + q % kWarps / kGroup + row_stride * (q / kWarps);
      const int k = (first_slice + q % kWarps % kGroup) * slice_elems<T>() + e % 32 * kVec;
      const bool fill = row < rank && k < hidden_in;
      cp_async_16(a_shared + e, fill ? lora_a + static_cast<size_t>(row) * hidden_in + k : x, fill);
    }
  };
  load_pieces(0);
  for (int e = threadIdx.x; e < size * kGroup * 32; e += kThreads) {  // x slices of the chunk's tokens
    const int j = e / (kGroup * 32), k = (first_slice + e / 32 % kGroup) * slice_elems<T>() + e % 32 * kVec;
    const bool fill = k < hidden_in;
    cp_async_16(x_shared + e, fill ? x + static_cast<size_t>(chunk.tokens[j]) * hidden_in + k : x, fill);
  }
  cp_async_commit();

  for (int row0 = 0;;) {
    cp_async_wait<0>();
    __syncthreads();
    // The row this lane's warp_sum_8 result belongs to.
    const int row = row0 + warp / kGroup + row_stride * ((lane >> 2) & 7);
    const bool writes = lane % 4 == 0 && row < rank && slice < num_slices;
    const uint4* pieces = a_shared + warp * 32 + lane;  // piece warp + 8 i at pieces[i * 8 * 32]
    for (int j0 = 0; j0 < size; j0 += 2) {  // two tokens at a time: two independent reduction chains
      float x_vals[2][kVec], dots[2][kRowsPerWarp];
#pragma unroll
      for (int t = 0; t < 2; ++t)
        widen<T>(x_shared[(min(j0 + t, size - 1) * kGroup + warp % kGroup) * 32 + lane], x_vals[t]);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        float a_vals[kVec];
        widen<T>(load_shared_16(pieces + i * kWarps * 32), a_vals);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          dots[t][i] = 0.f;
#pragma unroll
          for (int e = 0; e < kVec; ++e) dots[t][i] = fmaf(a_vals[e], x_vals[t][e], dots[t][i]);
        }
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const float sum = warp_sum_8(dots[t]);
        if (writes && j0 + t < size)
          v_partial[(static_cast<size_t>(slice) * num_tokens + position + j0 + t) * max_rank + row] = sum;
      }
    }
    row0 += rows_per_pass;
    if (row0 >= rank) break;
    __syncthreads();  // every warp is done with the pieces before they are replaced
    load_pieces(row0);
    cp_async_commit();
  }
}

// Grid (X, K slices / kLeastGroup, G), kLeastGroup = group_for(max_rank, K slices); each chunk's blocks take the
// group of its rank. Without a chunk-start list, X = T, a block per position; with one, X makes kWalkingWaves waves
// of blocks that walk it (walk_positions), so the positions that start no chunk cost no block.
template <typename T, int kLeastGroup>
__global__ void __launch_bounds__(kThreads, 4)
shrink_chunk_kernel(const T* __restrict__ x, const T* __restrict__ pool, const int64_t* __restrict__ a_offsets,
                    const int32_t* __restrict__ lora_ranks, const int32_t* __restrict__ sorted_token_ids,
                    const int32_t* __restrict__ sorted_slots, const int32_t* __restrict__ positions,
                    float* __restrict__ v_partial, int num_tokens, int hidden_in, int max_rank, int num_slots,
                    int num_slices, T* __restrict__ zero_y, int row_width) {
  allow_dependent_launch();  // every shrink block has started: the expand grid may fill the free multiprocessors
  if (zero_y != nullptr) {  // y is written, not added to: rows x, x + X, ... zeroed, a share per block of each
    const int row_vectors = row_width / Vec<T>::kSize;
    const int blocks = gridDim.y * gridDim.z, block = blockIdx.z * gridDim.y + blockIdx.y;
    const int first = row_vectors * block / blocks, last = row_vectors * (block + 1) / blocks;
    for (int r = blockIdx.x; r < num_tokens; r += gridDim.x) {
      uint4* row = reinterpret_cast<uint4*>(zero_y + static_cast<size_t>(r) * row_width);
      for (int i = first + threadIdx.x; i < last; i += kThreads) row[i] = make_uint4(0, 0, 0, 0);
    }
  }
  const int output = blockIdx.z;
  a_offsets += static_cast<size_t>(output) * num_slots;
  lora_ranks += static_cast<size_t>(output) * num_slots;
  v_partial += static_cast<size_t>(output) * num_slices * num_tokens * max_rank;
  __shared__ Chunk chunk;
  walk_positions(positions, num_tokens, [&](int position) {
    find_chunk(sorted_token_ids, sorted_slots, lora_ranks, a_offsets, nullptr, num_tokens, num_slots, max_rank,
               position, chunk);
    if (chunk.size == 0) return;
    // Groups below kLeastGroup never occur here (the rank is at most max_rank): not compiled.
    switch (group_for(chunk.rank, num_slices)) {
      case 4:
        if constexpr (kLeastGroup <= 4)
          shrink_at<T, 4>(x, pool, v_partial, num_tokens, hidden_in, max_rank, num_slices, position, chunk);
        break;
      case 2:
        if constexpr (kLeastGroup <= 2)
          shrink_at<T, 2>(x, pool, v_partial, num_tokens, hidden_in, max_rank, num_slices, position, chunk);
        break;
      default:
        if constexpr (kLeastGroup <= 1)
          shrink_at<T, 1>(x, pool, v_partial, num_tokens, hidden_in, max_rank, num_slices, position, chunk);
        break;
    }
  });
}

// Rank rows of the expand's Bt tile for a block of `group` column chunks: up to kTileRanks rows, and for a group of
// 2 or more up to the kBlockRows / group rows its chunk can have.
__host__ __device__ constexpr int expand_tile_rows(int max_rank, int group) {
  const int rows = group == 1 ? kTileRanks : kBlockRows / group;
  return max_rank < rows ? max_rank : rows;
}

// The expand's Bt tiles of a block of `group` column chunks, in 16-byte vectors: one buffer of a tile (two when a
// rank needs more than kTileRanks rows), and at least room for the warps' fp32 sums (up to 8 per lane), which reuse
// it at the end.
__host__ __device__ constexpr int expand_tile_vectors(int max_rank, int group) {
  const int buffers = group == 1 && max_rank > kTileRanks ? 2 : 1;
  const int tiles = buffers * expand_tile_rows(max_rank, group) * group * 32;
  return tiles > kWarps * 32 * 2 ? tiles : kWarps * 32 * 2;
}

// y[token(p), n] += sum_{r < rank} Bt_s[r, n] * v[p, r] for the positions p of `chunk` (looked up, size > 0),
// which starts at sorted position `position`, v[p, r] = sum over slices of
// v_partial; n runs over output blockIdx.z's columns of y. The block takes kGroup consecutive column chunks of
// 32 x 16 bytes. Work items are (token, column chunk) pairs, each lane a 16-byte run of outputs: with 8 items or
// more, warp w owns items w and w + 8; with fewer, each item has several warps, each taking every split-th rank row.
// Dynamic shared memory: v [kChunk][max_rank] fp32, Bt tiles [buffers][tile_rows][kGroup * 32]
// (expand_tile_vectors), then y [kChunk][kGroup * 32] (16-byte vectors): each group's layout within
// expand_smem_bytes. Two buffers only when the rank needs more than one tile (kGroup > 1 means rank <= 32).
template <typename T, int kGroup>
__device__ __forceinline__ void expand_at(T* __restrict__ y, const T* __restrict__ pool,
                                          const float* __restrict__ v_partial, int num_tokens, int hidden_out,
                                          size_t row_width, int max_rank, int num_slices, bool accumulate,
                                          int position, const Chunk& chunk) {
  constexpr int kVec = Vec<T>::kSize;
  extern __shared__ uint4 smem_vectors[];
  const int col0 = blockIdx.y * kGroup * slice_elems<T>();
  if (col0 >= hidden_out) return;  // a chunk of small rank (or a narrow output) needs fewer blocks than the grid has
  const int size = chunk.size;
  const int rank = chunk.rank;
  const T* lora_bt = pool + chunk.b_offset;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  constexpr int row_vectors = kGroup * 32;
  const int tile_rows = expand_tile_rows(max_rank, kGroup);
  float* v_shared = reinterpret_cast<float*>(smem_vectors);
  uint4* tiles = smem_vectors + kChunk * max_rank / 4;
  uint4* y_tile = tiles + expand_tile_vectors(max_rank, kGroup);

  // Rank rows [tile * kTileRanks, +kTileRanks) of Bt, this block's columns, into buffer `buffer`.
  auto load_tile = [&](int tile, int buffer) {
    const int first = tile * kTileRanks;
    const int rows = min(kTileRanks, rank - first);
    for (int i = threadIdx.x; i < rows * row_vectors; i += kThreads) {
      const int r = i / row_vectors, c = col0 + i % row_vectors * kVec;
      if (c < hidden_out)
        cp_async_16(tiles + (buffer * tile_rows + r) * row_vectors + i % row_vectors,
                    lora_bt + static_cast<size_t>(first + r) * hidden_out + c, true);
    }
  };
  load_tile(0, 0);
  for (int i = threadIdx.x; accumulate && i < size * row_vectors; i += kThreads) {  // y rows of the chunk's tokens
    const int c = col0 + i % row_vectors * kVec;
    if (c < hidden_out)
      cp_async_16(y_tile + i, y + chunk.tokens[i / row_vectors] * row_width + c, true);
  }
  cp_async_commit();

  wait_for_primary_grid();  // the shrink's partials are complete from here on
  // v[j, r] = sum over slices: lanes_per_entry consecutive lanes share an entry (j, r), each summing every
  // lanes_per_entry-th slice, so small chunks still have one L2 round trip of loads in flight; then shuffles.
  const int entries = size * rank;
  int lanes_per_entry = 1;
  while (lanes_per_entry < 32 && 2 * lanes_per_entry * entries <= kThreads && 2 * lanes_per_entry <= num_slices)
    lanes_per_entry *= 2;
  const size_t slice_stride = static_cast<size_t>(num_tokens) * max_rank;
  for (int base = 0; base < entries * lanes_per_entry; base += kThreads) {  // uniform trip count: whole warps
    const int i = base + threadIdx.x, entry = i / lanes_per_entry, part = i % lanes_per_entry;
    const int j = entry / rank, r = entry % rank;
    float sum = 0.f;
    if (entry < entries) {
      const float* partial = v_partial + static_cast<size_t>(position + j) * max_rank + r;
      // kSumBatch predicated loads per batch, all in flight before the first add (a runtime-bounded loop is
      // compiled into one load at a time: kernel v3's first run lost up to 16 L2 round trips here).
      for (int s0 = part; s0 < num_slices; s0 += kSumBatch * lanes_per_entry) {
        float parts[kSumBatch];
#pragma unroll
        for (int b = 0; b < kSumBatch; ++b) {
          const int s = s0 + b * lanes_per_entry;
          parts[b] = s < num_slices ? partial[s * slice_stride] : 0.f;
        }
#pragma unroll
        for (int b = 0; b < kSumBatch; ++b) sum += parts[b];
      }
    }
    for (int offset = lanes_per_entry / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
    if (entry < entries && part == 0) v_shared[j * max_rank + r] = sum;
  }

  // Items: (token, column chunk) pairs, at most kWarps * kItemsPerWarp. From rank kSplitMinRank, a chunk with fewer
  // items than warps has each item's rank rows split over `split` warps (at least 8 rows each), their sums then
  // added in warp order: deterministic. A lone token at rank 64 is one item, which one warp ran through 64 rows
  // while seven waited (splitting measured faster for rank-64 distinct rows; at rank 16, 4 items of 16 rows, the
  // added reduction cost what it saved).
  const int items = size * kGroup;
  int split = 1;
  while (rank >= kSplitMinRank && split < kWarps && 2 * split * items <= kWarps && rank >= 16 * split) split *= 2;
  const int part = warp % split;  // this warp's rank rows: part, part + split, ...
  bool valid[kItemsPerWarp];
  int item_of[kItemsPerWarp];
  const uint4* b_columns[kItemsPerWarp];  // the item's column chunk in a tile's row 0, this lane's vector
  const float* v_rows[kItemsPerWarp];
#pragma unroll
  for (int u = 0; u < kItemsPerWarp; ++u) {
    item_of[u] = warp / split + u * (kWarps / split);  // token item / kGroup, column chunk item % kGroup
    valid[u] = item_of[u] < items;
    b_columns[u] = tiles + item_of[u] % kGroup * 32 + lane;
    v_rows[u] = v_shared + item_of[u] / kGroup * max_rank;
  }
  float acc[kItemsPerWarp][kVec] = {};
  const int num_tiles = (rank + kTileRanks - 1) / kTileRanks;
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) load_tile(tile + 1, (tile + 1) % 2);
    cp_async_commit();
    cp_async_wait<1>();  // tile `tile` (and the y rows) have landed; the next tile may still be in flight
    __syncthreads();     // ... for every thread's copies; v_shared complete
    const int buffer_offset = (tile % 2) * tile_rows * row_vectors;
    const int first_row = tile * kTileRanks;
    const int num_rows = min(kTileRanks, rank - first_row);
#pragma unroll 4
    for (int r = part; r < num_rows; r += split) {
#pragma unroll
      for (int u = 0; u < kItemsPerWarp; ++u) {
        if (valid[u]) {
          float b[kVec];
          widen<T>(b_columns[u][buffer_offset + r * row_vectors], b);
          const float v = v_rows[u][first_row + r];
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[u][e] = fmaf(b[e], v, acc[u][e]);
        }
      }
    }
    __syncthreads();  // everyone is done with this buffer before the next iteration refills it
  }
  if (split > 1) {  // one item per warp (u = 0): its split warps' sums, in warp order, into the first one's acc
    float* sums = reinterpret_cast<float*>(tiles);  // [kWarps][32][kVec]: the tiles are no longer read
#pragma unroll
    for (int e = 0; e < kVec; ++e) sums[(warp * 32 + lane) * kVec + e] = acc[0][e];
    __syncthreads();
    for (int w = warp + 1; part == 0 && w < warp + split; ++w) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[0][e] += sums[(w * 32 + lane) * kVec + e];
    }
  }
  // y += acc, stored straight from registers, by the first warp of each item.
#pragma unroll
  for (int u = 0; u < kItemsPerWarp; ++u) {
    const int item = item_of[u];
    const int col = col0 + item % kGroup * slice_elems<T>() + lane * kVec;
    if (valid[u] && part == 0 && col < hidden_out) {
      float values[kVec] = {};
      if (accumulate) widen<T>(y_tile[item / kGroup * row_vectors + item % kGroup * 32 + lane], values);
#pragma unroll
      for (int e = 0; e < kVec; ++e) values[e] += acc[u][e];
      *reinterpret_cast<uint4*>(y + chunk.tokens[item / kGroup] * row_width + col) = narrow<T>(values);
    }
  }
}

// Grid (X, expand_extent's blocks, G), X, the position list and the groups as for the shrink, each output's groups
// chosen with its own column chunks: an output computes the same bits in a grouped call as alone.
template <typename T, int kLeastGroup>
__global__ void __launch_bounds__(kThreads, 4)
expand_chunk_kernel(T* __restrict__ y, const T* __restrict__ pool, const int64_t* __restrict__ b_offsets,
                    const int32_t* __restrict__ lora_ranks, const int32_t* __restrict__ sorted_token_ids,
                    const int32_t* __restrict__ sorted_slots, const int32_t* __restrict__ positions,
                    const float* __restrict__ v_partial, int num_tokens, const __grid_constant__ OutputColumns columns,
                    int max_rank, int num_slots, int num_slices, bool accumulate) {
  const int output = blockIdx.z;
  const int hidden_out = columns.begin[output + 1] - columns.begin[output];
  // Past this output's columns at every group (the grid covers the widest output of a group): no lookup.
  if (blockIdx.y * kLeastGroup * slice_elems<T>() >= hidden_out) return;
  const int col_chunks = (hidden_out + slice_elems<T>() - 1) / slice_elems<T>();
  const size_t row_width = columns.begin[columns.count];
  y += columns.begin[output];
  b_offsets += static_cast<size_t>(output) * num_slots;
  lora_ranks += static_cast<size_t>(output) * num_slots;
  v_partial += static_cast<size_t>(output) * num_slices * num_tokens * max_rank;
  __shared__ Chunk chunk;
  walk_positions(positions, num_tokens, [&](int position) {
    find_chunk(sorted_token_ids, sorted_slots, lora_ranks, nullptr, b_offsets, num_tokens, num_slots, max_rank,
               position, chunk);
    if (chunk.size == 0) return;
    switch (group_for(chunk.rank, col_chunks)) {  // as in the shrink
      case 4:
        if constexpr (kLeastGroup <= 4)
          expand_at<T, 4>(y, pool, v_partial, num_tokens, hidden_out, row_width, max_rank, num_slices, accumulate,
                          position, chunk);
        break;
      case 2:
        if constexpr (kLeastGroup <= 2)
          expand_at<T, 2>(y, pool, v_partial, num_tokens, hidden_out, row_width, max_rank, num_slices, accumulate,
                          position, chunk);
        break;
      default:
        if constexpr (kLeastGroup <= 1)
          expand_at<T, 1>(y, pool, v_partial, num_tokens, hidden_out, row_width, max_rank, num_slices, accumulate,
                          position, chunk);
        break;
    }
  });
}

int num_slices_for(const PunicaLoraProblem& p) {
  const int slice = p.dtype == PUNICA_FLOAT32 ? slice_elems<float>() : slice_elems<__half>();
  return (p.hidden_in + slice - 1) / slice;
}

// The expand's shared memory: v, then the largest of the Bt tiles and y tile of the groups from least_group up.
size_t expand_smem_bytes(int max_rank, int least_group) {
  int vectors = 0;
  for (int group = least_group; group <= kMaxGroup; group *= 2)
    vectors = std::max(vectors, expand_tile_vectors(max_rank, group) + kChunk * group * 32);
  return static_cast<size_t>(kChunk) * max_rank * sizeof(float) + static_cast<size_t>(vectors) * sizeof(uint4);
}

// Waves of resident blocks (the launch bounds' 4 per multiprocessor) a walking grid holds: each block serves several
// list entries in turn. Walking pays where most positions start no chunk (a mixed step's prefill tokens), not at
// decode sizes, where a block that draws several rank-64 chunks holds the call (benchmarks/KERNEL_NOTES.md).
constexpr int kWalkingWaves = 2;

// The grid: one block per position along x, or with a chunk-start list kWalkingWaves waves of blocks over the other
// extents, which walk the list.
dim3 walking_grid(const PunicaLoraProblem& p, const int32_t* positions, int blocks_y) {
  int blocks_x = p.num_tokens;
  if (positions != nullptr) {
    const int per_x = blocks_y * p.num_outputs;
    blocks_x = std::max(1, std::min(p.num_tokens, (kWalkingWaves * 4 * p.num_sms + per_x - 1) / per_x));
  }
  return dim3(blocks_x, blocks_y, p.num_outputs);
}

template <typename T, int kLeastGroup>
cudaError_t launch_shrink(const PunicaLoraProblem& p, const int32_t* positions, float* v_partial, int num_slices,
                          cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(kPieces + kChunk * kMaxGroup) * 32 * sizeof(uint4);
  static DynamicSmemLimit smem_limit;
  const cudaError_t err =
      smem_limit.ensure(reinterpret_cast<const void*>(shrink_chunk_kernel<T, kLeastGroup>), p.device, smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(shrink_chunk_kernel<T, kLeastGroup>,
                       walking_grid(p, positions, (num_slices + kLeastGroup - 1) / kLeastGroup),
                       dim3(kThreads), smem, stream, LaunchOptions{}, static_cast<const T*>(p.x),
                       static_cast<const T*>(p.pool), p.a_offsets, p.lora_ranks, p.sorted_token_ids, p.sorted_slots,
                       positions, v_partial, p.num_tokens, p.hidden_in, p.max_rank, p.num_slots, num_slices,
                       p.accumulate ? static_cast<T*>(nullptr) : static_cast<T*>(p.y), p.hidden_out);
}

// The expand's least group (the smallest group_for(max_rank, column chunks) over the outputs: no block takes a
// smaller one) and its grid's y extent (the most blocks an output needs at its group for max_rank).
struct ExpandExtent {
  int least_group = kMaxGroup;
  int blocks = 1;
};
template <typename T>
ExpandExtent expand_extent(const PunicaLoraProblem& p) {
  ExpandExtent extent;
  for (int g = 0; g < p.num_outputs; ++g) {
    const int chunks = (p.output_columns[g + 1] - p.output_columns[g] + slice_elems<T>() - 1) / slice_elems<T>();
    const int group = group_for(p.max_rank, chunks);
    extent.least_group = std::min(extent.least_group, group);
    extent.blocks = std::max(extent.blocks, (chunks + group - 1) / group);
  }
  return extent;
}

template <typename T, int kLeastGroup>
cudaError_t launch_expand(const PunicaLoraProblem& p, const int32_t* positions, const float* v_partial,
                          int num_slices, int blocks_y, cudaStream_t stream) {
  const size_t smem = expand_smem_bytes(p.max_rank, kLeastGroup);
  static DynamicSmemLimit smem_limit;
  const cudaError_t err =
      smem_limit.ensure(reinterpret_cast<const void*>(expand_chunk_kernel<T, kLeastGroup>), p.device, smem);
  if (err != cudaSuccess) return err;
  return launch_kernel(expand_chunk_kernel<T, kLeastGroup>, walking_grid(p, positions, blocks_y), dim3(kThreads),
                       smem, stream, LaunchOptions{p.programmatic_launch != 0}, static_cast<T*>(p.y),
                       static_cast<const T*>(p.pool), p.b_offsets, p.lora_ranks, p.sorted_token_ids, p.sorted_slots,
                       positions, v_partial, p.num_tokens, output_columns_of(p), p.max_rank, p.num_slots,
                       num_slices, p.accumulate != 0);
}

template <typename T>
cudaError_t launch(const PunicaLoraProblem& p, const int32_t* positions, float* v_partial, cudaStream_t stream) {
  const int num_slices = num_slices_for(p);
  cudaError_t err;
  switch (group_for(p.max_rank, num_slices)) {
    case 4: err = launch_shrink<T, 4>(p, positions, v_partial, num_slices, stream); break;
    case 2: err = launch_shrink<T, 2>(p, positions, v_partial, num_slices, stream); break;
    default: err = launch_shrink<T, 1>(p, positions, v_partial, num_slices, stream); break;
  }
  if (err != cudaSuccess) return err;
  const ExpandExtent extent = expand_extent<T>(p);
  switch (extent.least_group) {
    case 4: return launch_expand<T, 4>(p, positions, v_partial, num_slices, extent.blocks, stream);
    case 2: return launch_expand<T, 2>(p, positions, v_partial, num_slices, extent.blocks, stream);
    default: return launch_expand<T, 1>(p, positions, v_partial, num_slices, extent.blocks, stream);
  }
}

}  // namespace
}  // namespace punica

size_t punica_per_token_workspace_floats(const PunicaLoraProblem& p) {
  return static_cast<size_t>(punica::num_slices_for(p)) * p.num_tokens * p.max_rank * p.num_outputs;
}

cudaError_t punica_per_token_launch(const PunicaLoraProblem& p, const int32_t* positions, float* workspace,
                                    cudaStream_t stream) {
  switch (p.dtype) {
    case PUNICA_FLOAT32: return punica::launch<float>(p, positions, workspace, stream);
    case PUNICA_FLOAT16: return punica::launch<__half>(p, positions, workspace, stream);
    case PUNICA_BFLOAT16: return punica::launch<__nv_bfloat16>(p, positions, workspace, stream);
  }
  return cudaErrorInvalidValue;
}
