"""``python -m bitsparse.bench <suite>``: benchmarks that print a table."""

from __future__ import annotations

import argparse

from bitsparse.bench import codec, distributed, gpt, hooks, mlp, pipeline, steps, vision


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bitsparse.bench", description=__doc__)
    suites = parser.add_subparsers(dest="suite", required=True)
    codec.add_arguments(suites.add_parser("codec", help="encode/decode bandwidth against a copy"))
    gpt.add_arguments(suites.add_parser("gpt", help="12-layer GPT: memory and step time per mode"))
    mlp.add_arguments(suites.add_parser("mlp", help="MLP stack: memory and step time per mode"))
    pipeline.add_arguments(
        suites.add_parser("pipeline", help="one stage of a 1F1B pipeline schedule: peaks, waits and time per mode")
    )
    steps.add_arguments(suites.add_parser("steps", help="peak memory of each of the first steps, dense and BitSparse"))
    hooks.add_arguments(suites.add_parser("hooks", help="host time the hooks add per stored and per skipped tensor"))
    vision.add_arguments(suites.add_parser("vision", help="ResNet-50: memory and step time per mode (torchvision)"))
    distributed.add_arguments(
        suites.add_parser("distributed", help="12-layer GPT with FSDP2 under torchrun: memory and step time per GPU")
    )
    args = parser.parse_args(argv)
    if args.suite == "codec" and args.sweep:
        codec.sweep(args)
    elif args.suite == "codec":
        codec.run(args)
    elif args.suite == "gpt":
        gpt.run(args)
    elif args.suite == "mlp":
        mlp.run(args)
    elif args.suite == "pipeline":
        pipeline.run(args)
    elif args.suite == "steps" and args.child:
        steps.child(args)
    elif args.suite == "steps":
        steps.run(args)
    elif args.suite == "hooks":
        hooks.run(args)
    elif args.suite == "vision":
        vision.run(args)
    elif args.suite == "distributed":
        distributed.run(args)


if __name__ == "__main__":
    main()
