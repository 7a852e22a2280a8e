"""kvrt inside serving engines: `kvrt.integrations.vllm.KvrtConnector` (vLLM's v1 KV connector)."""
