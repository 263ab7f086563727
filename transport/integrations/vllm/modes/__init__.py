"""The ways a vLLM worker receives versions of a weight group, one strategy per file behind one
interface (base.py: :class:`~transport.integrations.vllm.modes.base.Mode`):

* staged.py: **sharded** and **whole**, into staging copies while vLLM serves;
* inplace.py: **inplace**, straight into the parameters vLLM computes with;
* streamed.py: **streamed**, in parts through two buckets into one reload;
* adapters.py: LoRA **adapters**, into vLLM's LoRA slots, one weight group per adapter.

choice.py picks the mode of a worker's base group (``auto``, or the one asked for) and says why;
loading.py is the layerwise reload the staged and streamed modes share.
"""
