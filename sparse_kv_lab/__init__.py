"""sparse-kv-lab: what runs the connector without serving a model, kept beside it and out of its wheel. It imports
connector (any of its packages); connector never imports it (`python -m connector demo|bench|bench-pd|serve-local`
finds it by name: connector/cli/main.py). Installed from this tree by `pip install -e ./lab` (lab/pyproject.toml).

A package imports only itself, connector and the packages listed above it; sim/ and pd/ not each other
(tests/test_layers.py holds this).

  sim/            simulated ranks over real NIXL between real processes: the demo, the bench, the soak, netns
  pd/             real `vllm serve` pairs as OS processes: the tiny model, servers, client, bench-pd, serve-local
  cli/            the commands `python -m connector` hands to the lab: demo, bench, bench-pd, serve-local"""
