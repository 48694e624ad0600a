"""``narwhal bench``: trace replay against an OpenAI-compatible endpoint, or a router fleet in virtual time.

Pure parts: :mod:`narwhal_bench.trace` (workloads and prompts),
:mod:`narwhal_bench.stats` (results, percentiles, goodput, hit rate),
:mod:`narwhal_bench.reader` (reading one answer's bytes). I/O:
:mod:`narwhal_bench.client` (sockets), :mod:`narwhal_bench.virtual` (the
discrete-event fleet, no sockets), :mod:`narwhal_bench.plot` (matplotlib).
See docs/bench.md.
"""
