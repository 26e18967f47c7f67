"""`python -m estimator_towers.selftest --help`: the self-test's command line (`cli`)."""

from estimator_towers.selftest import cli

if __name__ == '__main__':
  cli.run()
