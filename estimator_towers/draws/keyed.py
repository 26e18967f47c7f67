"""Keyed draws: a random op's draw is set by the example, not by the device that computes it.

The rule. With `random_draws='keyed'` (the default) every random op a
model_fn builds, on any tower, micro-batch or worker and on one device alike,
is drawn by a counter-based (Philox) stateless op instead:
- its **key** is the step's: made from the global step, read once per step
  before any write of it (a graph edge on every writer: `step_order`), and
  shared by every draw of the step;
- its **counter**'s high word is the op's own: the graph-level seed, the op
  seed the model_fn gave (if any) and the op's place among the random ops of
  its model_fn call (the same in every tower and on one device). A stateless
  op's key and counter are its own seed's (or the ones it was given);
- its counter's low word is set by the example's position in the global batch: a
  draw whose shape has the batch's rows (`tf.shape(x)` of rows, flat rows of
  a fixed count per example, stacked views) gives row i of the global batch
  what a draw of the whole batch gives it (`streams`: where a row fills whole
  Philox groups, the op asked for the shard's own shape at its first row's
  counter; else `streams.draw_rows`), so each
  device draws its own rows only, and a worker's rows keep their global
  positions. A draw whose shape does not depend on the batch (a scalar per
  step) is the same value on every tower. A draw shaped by a value that mixes
  the batch's rows runs once on the whole batch (the cross-example head), and
  draws there what one device draws.
So 1, N devices, k micro-batches and W workers draw the same values, and a
run stopped and resumed draws what an uninterrupted run draws. The values
differ from the undecorated model_fn's own stateful stream (the same
distribution); a stateless op of batch rows on axis 0 gives its own values.
Categorical draws are the Gumbel-max of keyed uniforms; a shuffle is
`StatelessShuffle` (passing no gradient, as `RandomShuffle`); a candidate
sampler (sampled softmax) keeps its stateful op, seeded the same on every
tower (the same candidates each step; a warning says that its stream
restarts with a session). Under a graph-level seed an unseeded op's key
leaves out the op seed the graph's counter gave it (which differs with the
tower); an op seed the model_fn gives is kept, whatever its value.

A random op inside a while loop's body is keyed by the loop's iteration too,
its rows by what enters the loop (`loop_keys`). What cannot be keyed is
refused at graph construction, naming the op and the fix: a random op inside
a function body or a loop's condition (or a v1 loop that counts no
iterations), a
`tf.random.Generator`, flat rows whose count per example only the values
decide (a pad remover's tokens), and Poisson, binomial or parameterised
truncated normal draws (or gamma draws of per-example parameters) with batch
rows. `random_draws='per_shard'` turns all of this off: each tower draws its
shard on its own, as the model_fn would, and the result then depends on the
device count.
"""

from __future__ import annotations

import hashlib
import inspect
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.draws import loop_keys
from estimator_towers.draws import step_order
from estimator_towers.draws import streams
from estimator_towers.inputs import sharding
from estimator_towers.rows import row_dependence as rd
from estimator_towers.towers import tower_context

__all__ = ['KeyedDraws', 'built_by_draws', 'positions_for', 'refusal', 'with_step_order']

SCOPE = 'keyed_draw'   # the name scope of the ops a keyed draw is made of

_PHILOX = 1
# gen_random_ops' stateful draws -> (streams' kind, the positions of shape and dtype / extras).
_STATEFUL = {'random_uniform': 'uniform', 'random_standard_normal': 'normal',
             'truncated_normal': 'truncated_normal', 'random_uniform_int': 'uniform_int'}
# gen_stateless_random_ops' seeded draws -> streams' kind.
_SEEDED = {'stateless_random_uniform': 'uniform', 'stateless_random_normal': 'normal',
           'stateless_truncated_normal': 'truncated_normal',
           'stateless_random_uniform_int': 'uniform_int',
           'stateless_random_uniform_full_int': 'uniform_full_int'}
# gen_stateless_random_ops_v2's keyed draws -> streams' kind.
_KEYED = {'stateless_random_uniform_v2': 'uniform', 'stateless_random_normal_v2': 'normal',
          'stateless_truncated_normal_v2': 'truncated_normal',
          'stateless_random_uniform_int_v2': 'uniform_int',
          'stateless_random_uniform_full_int_v2': 'uniform_full_int'}
# Draws with no counter to set, keyed only where nothing about them depends on the batch.
_UNKEYABLE = {'random_poisson': 'Poisson', 'random_poisson_v2': 'Poisson',
              'parameterized_truncated_normal': 'parameterised truncated normal',
              'stateless_random_poisson': 'Poisson', 'stateless_random_binomial': 'binomial',
              'stateless_parameterized_truncated_normal': 'parameterised truncated normal'}
# Every draw this module keys (or refuses); any other generated function (a key and counter,
# the algorithm, a gamma draw's gradient, a user's keyed shuffle) is TensorFlow's as ever.
_DRAWS = frozenset(_STATEFUL) | frozenset(_SEEDED) | frozenset(_KEYED) | frozenset(_UNKEYABLE) | {
    'multinomial', 'stateless_multinomial', 'random_gamma', 'stateless_random_gamma_v2',
    'stateless_random_gamma_v3', 'random_shuffle'}
def built_by_draws(op: tf.Operation) -> bool:
  """Whether `op` is part of a keyed draw (the library's, not the model_fn's own op)."""
  return any(part.startswith(SCOPE) for part in op.name.split('/')[:-1])


def refusal(op: str, why: str, fix: str) -> ValueError:
  """The error for a random op that cannot be keyed by the example."""
  return ValueError(
      f'estimator_towers draws every random op keyed by the example (random_draws=\'keyed\'), '
      f'so that an example gets the draw one device gives it on any device count, '
      f'micro-batch or worker; {op} cannot be: {why}. Fix: {fix}; or set '
      f'random_draws=\'per_shard\' (each tower then draws its shard on its own, and the '
      f'result depends on the device count).')


_of_graph: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # graph -> its KeyedDraws


def positions_for(graph: tf.Graph, k: int) -> dict:
  """{tower 0's position tensor's name: shard k's}: what a copy of tower 0's ops for shard k
  reads in place of tower 0's, for its keyed draws ({} without keyed draws); and the global
  batch's size, every shard's (across workers an all-reduce, which a copy cannot run again)."""
  draws = _of_graph.get(graph)
  if draws is None:
    return {}
  return {draws.position(0).name: draws.position(k), draws.batch.name: draws.batch}


def with_step_order(spec: tf.estimator.EstimatorSpec) -> tf.estimator.EstimatorSpec:
  """A TRAIN `spec` whose last hook orders the global step's writes that hooks build
  (`step_order.StepOrderHook`), where the default graph has keyed draws: the last training
  hook and the last chief hook (a chief's session begins its chief hooks after the others
  under a distribute coordinator, before them otherwise; a second `begin` orders nothing)."""
  draws = _of_graph.get(tf.compat.v1.get_default_graph())
  if draws is None:
    return spec
  hook = draws.step_order_hook()
  return spec._replace(
      training_hooks=tuple(spec.training_hooks or ()) + (hook,),
      training_chief_hooks=tuple(spec.training_chief_hooks or ()) + (hook,))


class KeyedDraws:
  """The keyed draws of one graph: wraps the model_fn calls that build its towers.

  Args:
    graph: the graph.
    sizes: the shards' sizes, in shard order (ints or int scalar tensors):
      shard k's first example is at `first_row + sum(sizes[:k])`.
    batch: the global batch size (int or tensor; the cluster's across workers).
    first_row: the global position of this worker's first example (0 on one
      worker).
  """

  def __init__(self, graph: tf.Graph, sizes: Sequence[Any], batch: Any, first_row: Any = 0):
    self.graph = graph
    with tf.name_scope('random_draws'), tf.control_dependencies(None):
      # [0, the step]: a copy of the step's read (a ref variable's read aliases its buffer),
      # which every write of the global step waits for (`step_order`).
      self.seed = tf.stack([tf.constant(0, tf.int64), _step_read(graph)], name='step_seed')
      # The step's Philox key, shared by every draw of the step; an op's counter is its own.
      self.key = tf.raw_ops.StatelessRandomGetKeyCounter(seed=self.seed)[0]
      self.batch = tf.cast(batch, tf.int64)
      self.positions, total = [], tf.cast(first_row, tf.int64)
      for size in sizes:
        self.positions.append(total)
        total = total + tf.cast(size, tf.int64)
    _of_graph[graph] = self

  @classmethod
  def of_shards(cls, graph: tf.Graph, shards: Any, across: Any = None) -> 'KeyedDraws':
    """The towers' shards (`inputs.shards.Shards`); `across`: the cluster's rows, if any."""
    if across is None:
      return cls(graph, shards.sizes, shards.batch)
    batch, first_row = across.rows_before(shards.batch)
    return cls(graph, shards.sizes, batch, first_row)

  @classmethod
  def whole_batch(cls, graph: tf.Graph, features: Any, labels: Any) -> 'KeyedDraws':
    """One device: the global batch is the model_fn's own input."""
    return cls(graph, [0], sharding.batch_size(features, labels))

  def position(self, k: int) -> tf.Tensor:
    """Shard k's first example's position in the global batch."""
    return self.positions[k] if k < len(self.positions) else self.positions[0]

  def wrap(self, run: Callable) -> Callable:
    """`run(features, labels, mode)` with its random ops keyed (see the module doc)."""

    def keyed_run(features, labels, mode):
      context, _ = tower_context.peek()
      build = _Build(self, features, labels, self.position(context.index),
                     towered_predict=mode == tf.estimator.ModeKeys.PREDICT and len(
                         self.positions) > 1)
      with interception.random_op_calls(build.handle), interception.shape_reads_kept(), \
          tf.compat.v1.variable_creator_scope(_initialised_as_ever):
        spec = run(features, labels, mode)
      self.order_step_writes()
      return spec
    return keyed_run

  def order_step_writes(self) -> None:
    """Every write of the global step the graph holds waits for the step's read
    (`step_order`; `step_order_hook` orders the ones hooks build later)."""
    step_order.order_writes(self.graph, self.seed.op)

  def step_order_hook(self) -> tf.compat.v1.train.SessionRunHook:
    """The hook that orders the writes of the global step that hooks build (the last one)."""
    return step_order.StepOrderHook(self.seed.op)


def _step_read(graph: tf.Graph) -> tf.Tensor:
  """The global step, as int64; 0 before it is initialised (a variable's random initial value)."""
  step = tf.compat.v1.train.get_global_step(graph)
  if step is None:
    return tf.constant(0, tf.int64, name='step')
  with tf.device(step.device):
    value = tf.cond(tf.compat.v1.is_variable_initialized(step),
                    lambda: tf.cast(step.read_value(), tf.int64),
                    lambda: tf.constant(0, tf.int64))
    return tf.identity(value, name='step')


def _transposed_rows(shape: tf.Tensor, kind_of: Callable) -> tuple | None:
  """(rows, perm) where `shape` is that of `tf.transpose(rows, perm)`, the batch moved."""
  op = shape.op
  while op.type in ('Cast', 'Identity'):
    op = op.inputs[0].op
  if op.type != 'Shape' or op.inputs[0].op.type != 'Transpose':
    return None
  rows, perm = op.inputs[0].op.inputs
  perm = tf.get_static_value(perm)
  if perm is None or len(perm) < 2 or perm[0] == 0 or kind_of(rows) != rd.Kind(rd.ROWS):
    return None
  return rows, [int(p) for p in perm]


def _initialised_as_ever(next_creator: Callable, **kwargs) -> Any:
  """A variable's initial value draws as TensorFlow does (once, by tower 0: not per shard)."""
  with interception.random_op_calls(_as_tensorflow_draws):
    return next_creator(**kwargs)


def _as_tensorflow_draws(module: str, name: str, original: Callable, args: tuple, kwargs: dict):
  del module, name
  return original(*args, **kwargs)


def _mix(*parts) -> int:
  digest = hashlib.sha256(repr(parts).encode()).digest()
  return int.from_bytes(digest[:8], 'little') & (2**63 - 1)


class _Build:
  """One model_fn call's keyed draws: its inputs' rows, its position, its random ops in order."""

  def __init__(self, draws: KeyedDraws, features: Any, labels: Any, position: tf.Tensor,
               towered_predict: bool = False):
    self.draws = draws
    self.position = position
    self.towered_predict = towered_predict   # no head on the whole batch draws a mixed shape
    self.rows = rd.GrowingRead(tf.nest.flatten((features, labels), expand_composites=True))
    self.ordinal = 0
    self.what = ''   # the random op being handled, for refusals
    # Where each random op is built: the model_fn's graph, a tf.cond's branch, a loop's body.
    self.loops = loop_keys.LoopPlaces(draws.graph, self.rows, position,
                                      lambda why, fix: refusal(self.what, why, fix))
    self.place = self.loops.place(draws.graph)

  # -- The call ----------------------------------------------------------------

  def handle(self, module: str, name: str, original: Callable, args: tuple, kwargs: dict):
    graph = tf.compat.v1.get_default_graph()
    if not (name in _DRAWS or module == 'stateful' or name.endswith('_candidate_sampler')):
      return original(*args, **kwargs)
    what = self.what = f'the random op {name} ({kwargs.get("name") or "unnamed"})'
    self.place = self.loops.place(graph)   # raises where a loop or function cannot key it
    if module == 'stateful':
      raise refusal(what, 'a tf.random.Generator draws from the state of a variable, which '
                          'every tower advances on its own', 'draw with tf.random.uniform / '
                          'tf.random.normal (or their stateless forms)')
    self.ordinal += 1
    call = _Call(module, name, original, _arguments(original, args, kwargs))
    call.op_seed = interception.given_op_seed()
    with tf.name_scope(SCOPE):
      return self._draw(call, what)

  def _draw(self, call: '_Call', what: str) -> Any:
    """The keyed draw of one random op's call."""
    name, module = call.name, call.module
    if module == 'candidate_sampling':
      return self._sampler(call)
    if name in _UNKEYABLE:
      return self._unkeyable(call, what, _UNKEYABLE[name])
    alg = tf.get_static_value(call.args.get('alg')) if module == 'stateless_v2' else None
    if alg is not None and alg not in (_PHILOX, 3):   # 3: 'auto_select', Philox on CPUs, GPUs
      raise refusal(what, f'its algorithm is not Philox (alg={call.args.get("alg")!r}), and a '
                          f'keyed draw sets a Philox counter', 'use alg=\'philox\' or '
                          '\'auto_select\' (TensorFlow\'s choice on CPUs and GPUs)')
    key, counter = self._key_counter(call)
    if name in ('multinomial', 'stateless_multinomial'):
      return self._categorical(call, key, _counter(counter, call.word))
    if name in ('random_shuffle',):   # no gradient, as RandomShuffle (StatelessShuffle has none)
      return tf.stop_gradient(interception.RANDOM_MODULES['stateless_v2'].stateless_shuffle(
          call.args['value'], key, _counter(counter, call.word), _PHILOX, name=call.args.get('name')))
    kind = _STATEFUL.get(name) or _SEEDED.get(name) or _KEYED.get(name) or 'gamma'
    trails = kind == 'gamma' and call.module == 'random'   # RandomGamma: shape + alpha's shape
    if trails and self._kind(call.args['alpha']) is not None:
      raise refusal(what, 'its alpha has the batch\'s rows, and a gamma draw\'s place in the '
                          'stream follows its shape only', 'draw gamma(shape=[batch], alpha) '
                          'of an alpha that does not depend on the batch')
    extra = {k: call.args[k] for k in ('minval', 'maxval') if call.args.get(k) is not None}
    return self.keyed(kind, call.args['shape'], call.dtype(), key, counter, what,
                      alpha=call.args.get('alpha'), alpha_trails=trails, word=call.word, **extra)

  def _key_counter(self, call: '_Call') -> tuple:
    """The draw's key and counter: the step's key and the op's own counter word [0, op], or
    the stateless op's own key and counter (`call.word`: the op's word, or None)."""
    v2 = interception.RANDOM_MODULES['stateless_v2']
    if call.module == 'stateless_v2':
      return call.args['key'], call.args['counter']
    if call.module == 'stateless':
      return v2.stateless_random_get_key_counter(call.args['seed'])
    call.word = self._op_key(call)
    if self.place.iteration is not None:   # in a loop: the op's word XOR its iterations' code
      call.word = tf.bitwise.bitwise_xor(tf.constant(call.word, tf.int64), self.place.iteration)
      return self.draws.key, None   # made where it is read (every op in a loop is kept per step)
    return self.draws.key, tf.bitcast(tf.constant([0, call.word], tf.int64), tf.uint64)

  def _op_key(self, call: '_Call') -> int:
    """The op's own part of the key: graph seed, the model_fn's op seed, its place."""
    seed, seed2 = int(call.args.get('seed') or 0), int(call.args.get('seed2') or 0)
    if call.op_seed is None:
      seed2 = -1   # the graph's op seed counter's, which differs with the tower: not the op's
    return _mix(seed, seed2, self.ordinal)

  def _kind(self, t: Any) -> rd.Kind | None:
    """`t`'s kind where the random op is built (`loop_keys`: the model_fn's graph, a
    `tf.cond` branch's, a loop's body)."""
    return self.place.kind(t) if isinstance(t, tf.Tensor) else None

  # -- Draws ---------------------------------------------------------------------

  def keyed(self, kind: str, shape: Any, dtype: tf.DType, key: tf.Tensor, counter: tf.Tensor,
            what: str, alpha: Any = None, alpha_trails: bool = False, word: Any = None,
            **extra) -> tf.Tensor:
    """The keyed draw of `shape`: rows by their global position, else one value everywhere.

    `alpha_trails`: a stateful gamma draw, whose shape is `shape` followed by
    alpha's (a stateless one broadcasts alpha to `shape`).
    """
    shape = tf.convert_to_tensor(shape)
    if shape.dtype not in (tf.int32, tf.int64):
      shape = tf.cast(shape, tf.int64)
    found = self._kind(shape)
    if alpha is not None:
      alpha = tf.convert_to_tensor(alpha)
      extra['alpha'] = alpha
    moved = _transposed_rows(shape, self._kind)
    if moved is not None:   # the batch on another axis (time-major): drawn batch-first
      rows, perm = moved
      return tf.transpose(self.keyed(kind, tf.shape(rows), dtype, key, counter, what, alpha,
                                     alpha_trails, word, **extra), perm)
    if found is not None and self.towered_predict and found.tag not in (
        rd.SHAPE, rd.LIFTED_SHAPE):
      raise refusal(what, f'its shape ({shape.name}) depends on the batch in a way the library '
                          f'cannot follow ({found.tag}), and in PREDICT each tower draws its own '
                          f'shard, with no head on the whole batch to draw it once',
                    'draw it with the shape of rows whose first axis is the batch '
                    '(tf.shape(x) of such an x, then reshape or transpose the draw), or '
                    'predict on one device')
    tail = tf.shape(alpha, out_type=shape.dtype) if alpha_trails else None
    if found is None or found.tag not in (rd.SHAPE, rd.LIFTED_SHAPE):
      # Not the batch's (one value on every tower), or mixed: drawn on the whole batch once.
      whole = shape if tail is None else tf.concat([shape, tail], 0)
      return streams.draw(kind, whole, dtype, key, _counter(counter, word), **extra)
    if self.place.iteration is not None and kind != 'gamma' and tail is None:
      padded = loop_keys.padded_rows(kind, shape, found, dtype, key, counter,
                                     None if counter is not None else word,
                                     self.place.position, extra)
      if padded is not None:   # a loop's draw of rows: few ops, each kept at every step
        self.place.mark(padded, rd.Kind(rd.ROWS))
        return padded
    aligned = self._aligned(kind, shape, found, dtype, key, counter, word, alpha_trails, extra)
    if aligned is not None:
      return aligned
    shape = tf.cast(shape, tf.int64)
    tail = shape[:0] if tail is None else tf.cast(tail, tf.int64)
    examples, per = self._examples(found, shape, what)
    row = tf.concat([tf.reshape(per, [1]), shape[1:], tail], 0)
    counter = _counter(counter, word)
    parts = [streams.draw_rows(kind, examples, row, dtype, key, counter,
                               self.place.position + j * self.draws.batch,
                               batch=self.draws.batch * found.blocks, **extra)
             for j in range(found.blocks)]
    result = tf.reshape(tf.concat(parts, 0) if len(parts) > 1 else parts[0],
                        tf.concat([shape, tail], 0))
    self.place.mark(
        result, rd.flat_kind(found.per, found.blocks) if found.layout == rd.FLAT
        else rd.Kind(rd.ROWS, found.blocks))
    return result

  def _aligned(self, kind: str, shape: tf.Tensor, found: rd.Kind, dtype: tf.DType,
               key: tf.Tensor, counter: tf.Tensor | None, word: Any, alpha_trails: bool,
               extra: dict) -> tf.Tensor | None:
    """The draw of rows whose elements (known when built) fill whole Philox groups: the op
    asked for the shard's shape itself at the counter of its first row; else None."""
    tail = loop_keys.static_tail(shape)
    alpha = extra.get('alpha')
    if alpha_trails:
      tail = None if tail is None or not alpha.shape.is_fully_defined() else (
          tail + alpha.shape.as_list())
    per = found.per if found.layout == rd.FLAT else 1
    if tail is None or found.blocks != 1 or not isinstance(per, int):
      return None
    if kind == 'gamma' and alpha.shape.num_elements() != 1 and (
        alpha_trails or alpha.shape.rank != len(tail) + 1):
      return None   # an alpha shared by the rows: numbered alpha first (`streams`)
    elements = per * int(np.prod(tail, dtype=np.int64))
    group = streams.group_size(kind, dtype)
    if elements % group:
      return None
    steps = self.place.position * (elements // group * streams.group_skip(kind, dtype))
    counter = (tf.bitcast(tf.stack([steps, tf.convert_to_tensor(word, tf.int64)]), tf.uint64)
               if word is not None else streams.advance(counter, steps))
    if alpha_trails:
      shape = tf.concat([shape, tf.shape(alpha, out_type=shape.dtype)], 0)
    result = streams.draw(kind, shape, dtype, key, counter, **extra)
    self.place.mark(
        result, rd.flat_kind(found.per) if found.layout == rd.FLAT else rd.Kind(rd.ROWS))
    return result

  def _examples(self, found: rd.Kind, shape: tf.Tensor, what: str) -> tuple:
    """(the shard's examples, rows per example) of a shape of rows or flat rows."""
    rows = [t for t in self.rows.inputs if self.rows.kind(t) == rd.Kind(rd.ROWS)
            and t.graph is shape.graph]
    if found.tag == rd.LIFTED_SHAPE or (found.layout == rd.FLAT and not (
        isinstance(found.per, int) or rd.same_for_each(found.per) and rows)):
      raise refusal(what, 'its shape is that of flat rows whose count per example only the '
                          'values decide (the tokens a pad remover keeps, a SparseTensor\'s '
                          'entries)', 'draw it on the padded [batch, length, ...] tensor '
                          'before the padding is removed')
    if found.layout != rd.FLAT:
      return shape[0] // found.blocks, tf.constant(1, tf.int64)
    if isinstance(found.per, int):
      return shape[0] // (found.blocks * found.per), tf.constant(found.per, tf.int64)
    examples = tf.shape(rows[0], out_type=tf.int64)[0]
    return examples, shape[0] // tf.maximum(found.blocks * examples, 1)

  def _categorical(self, call: '_Call', key: tf.Tensor, counter: tf.Tensor) -> tf.Tensor:
    """Gumbel-max of keyed uniforms: [n, num_samples, classes] per row of logits."""
    logits = tf.convert_to_tensor(call.args['logits'])
    samples = tf.cast(call.args['num_samples'], tf.int32)
    shape = tf.concat([tf.shape(logits)[:1], tf.reshape(samples, [1]), tf.shape(logits)[1:]], 0)
    u = self.keyed('uniform', shape, tf.float64, key, counter, 'a categorical draw')
    tiny = 2.0 ** -1022   # float64's smallest normal number (DType has no .tiny)
    gumbel = -tf.math.log(-tf.math.log(tiny + (1.0 - tiny) * u))
    scores = tf.cast(tf.expand_dims(logits, 1), tf.float64) + gumbel
    out = call.args.get('output_dtype', tf.int64)
    return tf.math.argmax(scores, axis=-1, output_type=tf.as_dtype(out))

  def _unkeyable(self, call: '_Call', what: str, family: str) -> tf.Tensor:
    """A draw with no counter to set: the same everywhere where nothing is the batch's."""
    tensors = [v for v in call.args.values() if isinstance(v, (tf.Tensor, list, tuple))]
    if any(self._kind(tf.convert_to_tensor(v)) is not None for v in tensors
           if not isinstance(v, (list, tuple)) or v):
      raise refusal(what, f'a {family} draw has no counter to set by the example, and this '
                          f'one has the batch\'s rows', f'draw uniform or normal noise and '
                          f'transform it, or draw it with a shape that does not depend on '
                          f'the batch')
    if call.module != 'random':
      return call.original(**call.args)   # seeded by the model_fn: the same everywhere
    seed = self.draws.seed + tf.constant([self._op_key(call), 0], tf.int64)
    if self.place.iteration is not None:   # in a loop: by its iterations too
      seed = tf.stack([tf.bitwise.bitwise_xor(seed[0], self.place.iteration), seed[1]])
    stateless, args = interception.RANDOM_MODULES['stateless'], call.args
    if 'poisson' in call.name:
      return stateless.stateless_random_poisson(args['shape'], seed, args['rate'],
                                                dtype=args.get('dtype', tf.int64))
    return stateless.stateless_parameterized_truncated_normal(
        args['shape'], seed, args['means'], args['stdevs'], args['minvals'], args['maxvals'])

  def _sampler(self, call: '_Call') -> Any:
    """A candidate sampler: its stateful op, seeded the same on every tower and device."""
    logs.warning_once(
        f'estimator_towers: the candidate sampler {call.name} draws the same candidates on '
        f'every tower (its op seeded the same), but from its own stream, which restarts '
        f'with each session: a resumed run draws the first steps\' candidates again.')
    named = dict(call.args)
    named['seed'], named['seed2'] = 1, _mix(self._op_key(call)) % (2**31 - 1) + 1
    return call.original(**named)


class _Call:
  """A generated random-op function's call: its arguments by name."""

  def __init__(self, module: str, name: str, original: Callable, bound: dict):
    self.module, self.name, self.original = module, name, original
    self.args = bound
    self.op_seed = None
    self.word = None   # the op's own counter word (its low word 0), if the library keys it

  def dtype(self) -> tf.DType:
    for key in ('dtype', 'Tout'):
      if self.args.get(key) is not None:
        return tf.as_dtype(self.args[key])
    for key in ('minval', 'alpha'):
      if self.args.get(key) is not None:
        return tf.convert_to_tensor(self.args[key]).dtype
    return tf.float32


def _counter(counter: tf.Tensor | None, word: Any) -> tf.Tensor:
  """`counter`, or [0, word] where a draw in a loop left it to be made where it is read."""
  if counter is not None:
    return counter
  return tf.bitcast(tf.stack([tf.constant(0, tf.int64), word]), tf.uint64)


def _arguments(original: Callable, args: tuple, kwargs: dict) -> dict:
  """{name: value} of a generated function's call."""
  return dict(inspect.signature(original).bind_partial(*args, **kwargs).arguments)
