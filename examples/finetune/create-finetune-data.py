"""Write a prompt/response JSONL for ``finetune.py`` from a public dataset or a local JSONL file.

Each output line is ``{"prompt": ..., "response": ...}``. A preset names a Hugging Face dataset and the template
that turns one of its records into a prompt; the response is one of the record's fields as it is:

    gsm8k   openai/gsm8k ("main")      question             -> answer (reasoning, then "#### <number>")
    sqlctx  b-mc2/sql-create-context   question + context   -> answer (a SQL query)
    viggo   GEM/viggo                  meaning_representation -> target (one sentence)

Online it reads the dataset with the ``datasets`` library (``pip install datasets``; not a punica_hf dependency):

    python create-finetune-data.py --preset gsm8k --output gsm8k.jsonl --limit 2000

Offline, ``--from-jsonl`` reads the records from a local JSONL instead. With a preset the records have the dataset's
own fields (e.g. written by ``datasets``' ``to_json``); ``--prompt-field`` / ``--response-field`` take the prompt and
the response verbatim from other fields, and without a preset they default to ``prompt`` and ``response``:

    python create-finetune-data.py --preset gsm8k --from-jsonl gsm8k-train.jsonl --output gsm8k.jsonl
    python create-finetune-data.py --from-jsonl mine.jsonl --prompt-field instruction --response-field output \\
        --output mine-prompts.jsonl

The same template must be used for prompts at serving time; the first line of the output shows it filled in.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from punica_hf.formats.jsonl import read_jsonl

# Exit status when the dataset cannot be read from the Hub (no ``datasets`` library or no network).
EXIT_DATASET_UNAVAILABLE = 2


@dataclass(frozen=True)
class Preset:
    dataset: str
    config: str | None
    # ``str.format`` template over the record's fields. It ends in a newline, not a space: BPE tokenizers make a
    # trailing space a token of its own, which pretrained models rarely saw before a word.
    prompt_template: str
    response_field: str

    @property
    def prompt_fields(self) -> list[str]:
        return [name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name]


PRESETS: dict[str, Preset] = {
    "gsm8k": Preset(
        dataset="openai/gsm8k",
        config="main",
        prompt_template="Solve the math problem step by step, then give the final answer after '####'.\n\n"
        "Question: {question}\nAnswer:\n",
        response_field="answer",
    ),
    "sqlctx": Preset(
        dataset="b-mc2/sql-create-context",
        config=None,
        prompt_template="Write a SQL query that answers the question, using these tables:\n{context}\n\n"
        "Question: {question}\nSQL:\n",
        response_field="answer",
    ),
    "viggo": Preset(
        dataset="GEM/viggo",
        config=None,
        prompt_template="Write one sentence about a video game that says exactly what this meaning representation "
        "says:\n{meaning_representation}\nSentence:\n",
        response_field="target",
    ),
}


class DatasetUnavailable(Exception):
    """The preset's dataset could not be read from the Hub."""


def read_hub_records(preset: Preset, split: str) -> Iterator[dict]:
    try:
        import datasets  # optional: only this online path needs it
    except ImportError:
        raise DatasetUnavailable("the 'datasets' library is not installed (pip install datasets)") from None
    try:
        dataset = datasets.load_dataset(preset.dataset, preset.config, split=split)
    except Exception as error:  # offline mode, no network, unknown split: all mean "cannot read it from here"
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DatasetUnavailable(f"loading {preset.dataset} failed: {first_line}") from None
    return iter(dataset)


def read_jsonl_records(path: Path) -> Iterator[dict]:
    return (record for _, record in read_jsonl(path))


def field_of(record: dict, field: str, record_number: int) -> str:
    if field not in record:
        raise ValueError(f"record {record_number} has no field {field!r} (its fields: {', '.join(record)})")
    return str(record[field])


def to_examples(
    records: Iterable[dict], preset: Preset | None, prompt_field: str | None, response_field: str, limit: int | None
) -> Iterator[dict[str, str]]:
    """``{"prompt", "response"}`` per record: the preset's template, or ``prompt_field`` verbatim when given."""
    for record_number, record in enumerate(records, start=1):
        if limit is not None and record_number > limit:
            return
        if prompt_field is not None:
            prompt = field_of(record, prompt_field, record_number)
        else:
            prompt = preset.prompt_template.format(
                **{name: field_of(record, name, record_number) for name in preset.prompt_fields}
            )
        yield {"prompt": prompt, "response": field_of(record, response_field, record_number)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Write a prompt/response JSONL for finetune.py.",
        epilog="Presets: " + "; ".join(f"{name} = {preset.dataset}" for name, preset in PRESETS.items()),
    )
    parser.add_argument("--preset", choices=PRESETS, help="dataset and prompt template")
    parser.add_argument("--output", required=True, type=Path, help="the JSONL file to write")
    parser.add_argument("--limit", type=int, help="keep only the first N records")
    parser.add_argument("--split", default="train", help="dataset split to read online (default: train)")
    parser.add_argument("--from-jsonl", type=Path, help="read records from this local JSONL instead of the Hub")
    parser.add_argument(
        "--prompt-field", help="the prompt, verbatim, from this field (default: the preset's template, else 'prompt')"
    )
    parser.add_argument(
        "--response-field", help="the response from this field (default: the preset's, else 'response')"
    )
    args = parser.parse_args(argv)
    if args.preset is None and args.from_jsonl is None:
        parser.error("give --preset to read a dataset from the Hub, or --from-jsonl to convert a local file")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.preset is None and args.prompt_field is None:
        args.prompt_field = "prompt"
    if args.response_field is None:
        args.response_field = PRESETS[args.preset].response_field if args.preset else "response"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS.get(args.preset)
    try:
        records = read_jsonl_records(args.from_jsonl) if args.from_jsonl else read_hub_records(preset, args.split)
    except DatasetUnavailable as reason:
        print(
            f"Cannot read the {args.preset} dataset ({preset.dataset}) here: {reason}.\n"
            "Offline, convert a local copy instead: --from-jsonl FILE.jsonl (records with the fields "
            f"{', '.join(preset.prompt_fields + [preset.response_field])}, or name yours with --prompt-field and "
            "--response-field).",
            file=sys.stderr,
        )
        return EXIT_DATASET_UNAVAILABLE

    args.output.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    try:
        with args.output.open("w", encoding="utf-8") as output:
            for example in to_examples(records, preset, args.prompt_field, args.response_field, args.limit):
                output.write(json.dumps(example, ensure_ascii=False) + "\n")
                written += 1
    except (OSError, ValueError) as error:
        args.output.unlink(missing_ok=True)  # no half-written file that looks like a finished one
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Wrote {written} examples to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
