"""Messages: the warning or error for a loss that depends on a mixing op.

The rule. Never silently wrong: where tower 0's loss depends on an op that
makes a row depend on other examples of the batch, and the library does not
compute it on the whole batch, `report` says so once per op at graph
construction: the loss, the first mixing op and why (and how many more),
what differs from the single-device model_fn and what to do. It is a
warning, an error with `loss_reduction='exact'`, and an error with
micro-batches, which never hold the whole batch's rows at once. An op the
reader cannot see inside or does not know "may make" a row depend on
others; the rest "makes" it.
"""

from __future__ import annotations

from estimator_towers.base import logs
from estimator_towers.base import spelling
from estimator_towers.rows.kinds import RowDependence
from estimator_towers.rows.op_tables import FUNCTIONS


def report(targets: list, found: RowDependence, loss_reduction: str,
           micro_batches: bool, note: str | None = None) -> None:
  """Warns of `found`'s first mixing op (or raises ValueError: see the module doc)."""
  first = found.mixing[0]
  what = (f'the loss {targets[0].name}' if len(targets) == 1
          else 'the tensors ' + ', '.join(t.name for t in targets))
  more = len(found.mixing) - 1
  others = (f' (and {more} more such op{"s" if more > 1 else ""}, first '
            f'{", ".join(repr(m.op.name) for m in found.mixing[1:4])}'
            f'{", ..." if more > 3 else ""})' if more else '')
  may = 'may make' if first.op.type in FUNCTIONS or 'does not know' in first.why else 'makes'
  mixes = (f'{what} depends on {first.describe()}{others}, which {may} a row depend on '
           f'other examples of the batch')
  if micro_batches:
    raise ValueError(
        f'{spelling.name("micro_batches")} > 1 cannot train this model_fn: {mixes}, and '
        f'micro-batches, which run one after another, never hold the whole batch\'s '
        f'rows at once, so such a loss trains only through its head on the whole batch, '
        f'which cannot be built here: {note or "the loss is not computed on the whole batch"}'
        f'. Use {spelling.setting("micro_batches", 1)} (see docs/cross_example.md).')
  where = (f'the whole batch\'s head cannot be built here: {note}' if note else
           'the library does not compute this loss on the whole batch here')
  message = (
      f'estimator_towers: {mixes}. Towers compute it on each shard\'s rows only, so the '
      f'result differs from the single-device model_fn\'s on the whole batch (an '
      f'in-batch softmax sees fewer negatives, a batch top-k picks other examples): '
      f'{where} (see docs/cross_example.md). Run this model_fn on one device for the '
      f'single-device result.')
  if loss_reduction == 'exact':
    raise ValueError(message + " loss_reduction='exact' makes this an error; use "
                     "loss_reduction='auto' to train with each shard's rows.")
  logs.warning_once(message + " Pass loss_reduction='exact' to make this an error.",
                    key=f'row_dependence:{first.op.name}')
