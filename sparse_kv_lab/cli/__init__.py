"""The lab's commands, which `python -m connector` adds to its own by module name (connector/cli/main.py): each
module's `add_subcommand(s)` adds its parsers to connector's.

  demo            `demo` and `bench` over the simulated ranks (sparse_kv_lab.sim)
  checks          a demo/bench run's checks: where a side's ranks run, time, memory, device
  yardsticks      what good looks like next to each number demo and bench print, and their verdicts
  bench_pd        `bench-pd`: argument checks and output for sparse_kv_lab.pd.bench
  serve_local     `serve-local`: a prefill, a decode and a router on this machine (sparse_kv_lab.pd.local)"""
