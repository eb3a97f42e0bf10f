#!/usr/bin/env bash
# Make a preset's prompt/response data, then fine-tune a LoRA adapter on it for one base model.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: finetune.sh PRESET [finetune.py options...]

  PRESET   gsm8k | sqlctx | viggo   (see create-finetune-data.py --help)

Writes WORK_DIR/PRESET.jsonl, then the PEFT adapter WORK_DIR/adapters/PRESET. Options after PRESET go to
finetune.py (e.g. --max-steps 500 --rank 16 --targets all-linear).

Environment:
  MODEL       base model, Hub id or local folder, or "demo" (default: meta-llama/Llama-3.2-1B)
  WORK_DIR    where data and adapters go (default: ./finetune-work)
  LIMIT       keep only the first LIMIT examples of the dataset (default: all)
  FROM_JSONL  read the dataset's records from this local JSONL instead of the Hub (offline)
  PYTHON      the Python to run (default: python)

Example:
  MODEL=Qwen/Qwen2.5-0.5B LIMIT=2000 ./finetune.sh gsm8k --max-steps 300
USAGE
}

if [[ $# -lt 1 ]]; then
    usage >&2
    exit 2
fi
case "$1" in
    -h | --help) usage; exit 0 ;;
    gsm8k | sqlctx | viggo) ;;
    *) echo "finetune.sh: unknown preset '$1'" >&2; usage >&2; exit 2 ;;
esac
preset=$1
shift

MODEL=${MODEL:-meta-llama/Llama-3.2-1B}
WORK_DIR=${WORK_DIR:-finetune-work}
PYTHON=${PYTHON:-python}
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
data_file="$WORK_DIR/$preset.jsonl"
adapter_dir="$WORK_DIR/adapters/$preset"

data_args=(--preset "$preset" --output "$data_file")
if [[ -n ${LIMIT:-} ]]; then data_args+=(--limit "$LIMIT"); fi
if [[ -n ${FROM_JSONL:-} ]]; then data_args+=(--from-jsonl "$FROM_JSONL"); fi

"$PYTHON" "$script_dir/create-finetune-data.py" "${data_args[@]}"
"$PYTHON" "$script_dir/finetune.py" --model "$MODEL" --data "$data_file" --output "$adapter_dir" "$@"
