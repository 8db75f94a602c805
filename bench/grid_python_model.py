#!/usr/bin/env python3
"""The budget grid's models defined in Python (issue 56), trained through `triaccel.train` as a user's script would.

    grid_python_model.py train --model tv-resnet18 --dataset cifar10 --data DIR --batch-size 96 --vram-budget 0.3GB ...

takes the `triaccel train` arguments bench/budget_grid.py builds (`--key value`, each the option `key` of
triaccel.options(); `--data` is `data_dir`), trains the model `--model` names on the dataset named, and ends as the
command line does: exit 0; a refusal (ValueError or TypeError: the engine's one-line user errors) as one
`triaccel: error:` line and exit 2; anything else as one `triaccel: internal error:` line and exit 1. The engine writes
OUT/events.jsonl as for the command line.

Models: tv-resnet18 (torchvision's ResNet-18 with the CIFAR stem a user sets: bench/python_models.py), py-gpt-tied
(the GPT-style character model with its embedding and output layer tied: bench/python_gpt.py; the vocabulary read from
the corpus, as the engine's text reader makes it).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def model_make(name, data_dir):
    if name == "tv-resnet18":
        import python_models
        return python_models.cifar_resnet18()
    if name == "py-gpt-tied":
        import python_gpt
        corpus = os.path.join(data_dir, "input.txt")
        if not os.path.isfile(corpus):  # as the engine's reader says it: a refusal, not a crash of this script
            raise ValueError(f"tinyshakespeare: input.txt not found in {data_dir}; pass --data with its folder")
        with open(corpus, "rb") as f:
            vocab = len(set(f.read()))
        return python_gpt.TiedGpt(vocab, tied=True)
    raise ValueError(f"grid_python_model.py: unknown model '{name}' (tv-resnet18, py-gpt-tied)")


def value_of(text):
    """An option's value as triaccel.train takes it: bool, int, float, or the string itself (e.g. 0.3GB)."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def options_of(argv):
    """{key: value} of `train --key value ...`; (model name, dataset name) taken out."""
    args = argv[1:] if argv and argv[0] == "train" else argv
    if len(args) % 2:
        raise SystemExit(f"grid_python_model.py: options come in pairs --key value, got {' '.join(args)}")
    opts = {}
    for flag, text in zip(args[::2], args[1::2]):
        if not flag.startswith("--"):
            raise SystemExit(f"grid_python_model.py: expected --key, got '{flag}'")
        key = flag[2:].replace("-", "_")
        opts["data_dir" if key == "data" else key] = value_of(text)
    return opts.pop("model"), opts.pop("dataset"), opts


def first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def main(argv):
    name, dataset, opts = options_of(argv)
    import torch
    import triaccel
    try:
        model = model_make(name, opts.get("data_dir", ""))
        triaccel.train(model, dataset=dataset, **opts)
    except (ValueError, TypeError) as e:
        print(f"triaccel: error: {first_line(e)}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as e:
        print(f"triaccel: internal error: out of GPU memory: {first_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 -- every other way out is the bug the grid counts
        print(f"triaccel: internal error: {type(e).__name__}: {first_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
