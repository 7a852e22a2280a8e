"""The connector's tests need vLLM, which lives in a venv of its own (`make test-vllm`): where it
is missing (`make test`) they are not collected."""

from importlib.util import find_spec

collect_ignore_glob = [] if find_spec("vllm") is not None else ["test_*.py"]
