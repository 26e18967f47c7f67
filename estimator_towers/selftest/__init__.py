"""The self-test a user runs on their own machine: `python -m estimator_towers.selftest`.

Not a stage of the data path: a tool above the public API. It reports the
environment (`environment`), checks on the user's devices that towered
training gives the one-device update (`exactness`), times ResNet-20 on 1 and
N devices and against MirroredStrategy (`speed`, with the model in
`resnet`), and prints one report (`report`); `cli` holds its flags and main.
With `--model_fn` and `--input_fn` it checks the user's own model instead
(`own_model`, from one initialisation: `one_start`; the names: `user_code`).
Each check runs on its own: a crash in one is that check's FAIL, and the
others still run. Nothing here is part of the stable API but the command line.

May import: everything (it sits above the public API).
"""
