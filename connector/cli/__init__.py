"""`python -m connector {plan,demo,bench}` and the `sparse-kv-connector` script: an argparse front end (args, main)
over the planning code, and the demo and bench over the simulated ranks (demo)."""

from connector.cli.main import main

__all__ = ["main"]
