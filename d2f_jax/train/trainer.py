"""One training run of any objective (distill, mdm, ar): set up mesh, models, data and state, then loop.

    trainer = Trainer(config, workdir)   # restores the latest checkpoint in workdir, if any
    history = trainer.run()              # to config.total_steps; saves, evaluates, exports the result

Everything that can resume does: the state and the data position come back from the newest readable
checkpoint (an unreadable newer one is moved aside), and the run continues with the same losses it would
have had without the interruption. A resume with a config that changes the trained state's shape or meaning
is refused before the workdir is touched. A non-finite loss, gradient or parameter stops the run
(`divergence.NonFiniteError`) before any checkpoint or export is written from that state. Every logged step is
appended to `<workdir>/metrics.jsonl` at once, so a killed run keeps the metrics of what it trained.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from d2f_jax import convert, sharding
from d2f_jax.models import LoraConfig
from d2f_jax import workdir_lock, xla_maps
from d2f_jax.reporting import write_text
from d2f_jax.train import config as config_lib
from d2f_jax.train import data as data_lib
from d2f_jax.train import metrics as metrics_lib
from d2f_jax.train import divergence, objectives
from d2f_jax.train.checkpoint import Checkpointer, StopSignal
from d2f_jax.train.model import TrainModels, export_student, exports_adapter, load_base, model_config
from d2f_jax.train.state import abstract_state, create_state
from d2f_jax.train.step import compiled_eval, compiled_train_step, spec_from_config, summarize
from d2f_jax.train.synthetic import ensure_synthetic

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def lora_config(config) -> LoraConfig | None:
  if config.finetune != "lora":
    return None
  c = config.lora
  return LoraConfig(rank=c.rank, alpha=float(c.alpha), dropout=float(c.dropout), targets=tuple(c.targets),
                    use_rslora=c.use_rslora)


class Trainer:
  """One run in `workdir`: models on the mesh, data, state (fresh or restored), writers.

  `frozen` holds the base weights when the objective has a teacher or the run is LoRA; a full fine-tune
  without a teacher (mdm, ar) holds only its train state (the base is read once, to start from).
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    config_lib.validate(config)
    sharding.maybe_initialize_distributed(config.distributed)
    self.config, self.workdir = config, os.path.abspath(workdir)
    self.is_main = jax.process_index() == 0
    self.preempted = False  # set when run() stopped early on SIGTERM / a preemption notice (checkpoint saved)
    os.makedirs(self.workdir, exist_ok=True)
    xla_maps.ensure_headroom(force=True)  # a process training stage after stage (the main job) compiles each
    # One process per workdir (process 0 for all hosts): two runs would write each other's checkpoints.
    self._lock = workdir_lock.acquire(self.workdir, what="training workdir") if self.is_main else None
    try:
      self._setup()
    except BaseException:
      self._release_lock()
      raise

  def _setup(self) -> None:
    config = self.config
    self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"), every=config.checkpoint.every,
                                     keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    config_lib.check_resume(self.workdir, config, self.checkpointer.latest_step())  # before anything is written
    self.mesh = sharding.make_mesh(config.mesh)
    self.rules = sharding.normalize_rules(config.logical_axis_rules)
    self.model_path, data_path, self.tokenizer_dir = self._paths()
    self._setup_models()
    self._setup_data(data_path)
    self._setup_state()
    if self.is_main:  # the restored checkpoint fits: from now on this config is the run's
      write_text(os.path.join(self.workdir, "config.json"), config.to_json_best_effort(indent=2))
    self.writer = metrics_lib.Writer(self.workdir)
    self.flops_per_token = metrics_lib.train_flops_per_token(
        self.models.config, config.data.seq_len, self.models.lora, teacher=self.models.teacher,
        passes=2 if self.spec.mdm_ar_weight else 1)
    self.peak_flops = metrics_lib.peak_flops_per_device(config.peak_flops)

  def _paths(self) -> tuple[str | None, str | None, str | None]:
    """(model dir to load, or None for a random init; data file; tokenizer dir): the config's, or a
    synthetic checkpoint + JSONL written once into the workdir."""
    c = self.config
    random_init = c.model.init == "random"
    if not c.model.synthetic:
      if random_init or not c.model.path:
        return None, c.data.path, c.data.tokenizer or c.model.path
      model_dir = convert.resolve_model_dir(c.model.path, what="config.model.path")  # the one look-up
      return model_dir, c.data.path, c.data.tokenizer or model_dir
    directory = os.path.join(self.workdir, "synthetic")
    base = model_config(c.model)
    if self.is_main:
      ensure_synthetic(directory, base, num_examples=c.data.synthetic_examples, seed=c.seed)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("d2f_jax synthetic data")
    model_dir, data_path = ensure_synthetic(directory, base, num_examples=c.data.synthetic_examples, seed=c.seed)
    return (None if random_init else model_dir), c.data.path or data_path, c.data.tokenizer or model_dir

  def _setup_models(self) -> None:
    c = self.config
    model_cfg = c.model.copy_and_resolve_references()
    with model_cfg.unlocked():
      model_cfg.path = self.model_path
    obj = objectives.get(c.objective)
    # The trained model attends as its objective teaches it (written into its exports' configs).
    trained = model_config(model_cfg, remat=c.remat, resolved_dir=self.model_path).replace(attention_kind=obj.attention)
    self.models = TrainModels.create(trained, lora_config(c), c.train_dtype, teacher=obj.teacher)
    self.base_shardings = sharding.state_shardings(self.models.abstract_base(), self.mesh, self.rules)
    self.frozen = self._load_base() if self.models.keeps_base else {}
    self.spec = spec_from_config(c, self.models, self.mesh, self.rules)

  def _load_base(self) -> dict:
    """Base weights in their shardings: from model_path, or random (seeded) without one."""
    c = self.config
    return load_base(self.models, self.model_path, c.seed, self.base_shardings, progress=c.progress_bar)

  def _setup_data(self, data_path: str | None) -> None:
    c = self.config
    if c.batch_size % jax.process_count():
      raise ValueError(f"config.batch_size={c.batch_size} must be a multiple of the {jax.process_count()} hosts")
    local_batch = c.batch_size // jax.process_count()
    data_cfg = c.data.copy_and_resolve_references()
    with data_cfg.unlocked():
      data_cfg.path = data_path
    train, held_out = data_lib.load_examples(data_cfg, tokenizer_dir=self.tokenizer_dir,
                                             eos_id=self.models.config.eos_token_id,
                                             cache_dir=os.path.join(self.workdir, "data_cache"))
    vocab = self.models.config.vocab_size
    for name, part in (("data.path", train), ("data.eval_path", held_out)):
      if len(part) and (part.tokens.min() < 0 or part.tokens.max() >= vocab):
        raise ValueError(f"config.{name}: token ids span [{part.tokens.min()}, {part.tokens.max()}], outside the "
                         f"model's vocabulary [0, {vocab})")
    self.data = data_lib.DataIterator(data_lib.train_dataset(
        train, local_batch, c.seed, c.data.prefetch, length_buckets=tuple(c.data.get("length_buckets", ())),
        eos_id=self.models.config.eos_token_id))
    self.eval_data = data_lib.eval_batches(held_out, local_batch, c.eval_batches)

  def _setup_state(self) -> None:
    """The newest checkpoint's state and data position, or a fresh state; both land in their shardings."""
    target = abstract_state(self.models, self.spec.optim, self.mesh, self.rules)
    restored = self.checkpointer.restore_newest(target, data_template=self.data.get_state())
    if restored is None:
      if self.models.keeps_base:
        base = self.frozen
      else:  # full fine-tune without a teacher: read the base once (or draw it in train_dtype), then drop it
        base = self._load_base() if self.model_path else None
      self.state = create_state(self.models, self.spec.optim, base, self.config.seed, self.mesh, self.rules)
      return
    latest, self.state, data_state = restored
    self.data.set_state(data_state)
    log.info("restored step %d from %s", latest, self.checkpointer.directory)

  @property
  def step(self) -> int:
    return int(jax.device_get(self.state.step))

  def global_batch(self, local: dict) -> dict:
    """Host-local numpy rows -> global arrays split over the batch axes."""
    return {k: jax.make_array_from_process_local_data(
        sharding.batch_sharding(self.mesh, self.rules, np.ndim(v)), np.asarray(v, np.int32)) for k, v in local.items()}

  def evaluate(self) -> dict:
    """The objective's loss (and its other metrics) on the held-out batches, each noised with its own
    fixed key, so evaluations at different steps are comparable."""
    if not self.eval_data:
      return {}
    fn = compiled_eval(self.spec, self.mesh, self.rules)
    key = jax.random.PRNGKey(self.config.seed + 2)
    totals = None
    for i, local in enumerate(self.eval_data):
      sums = fn(self.state.params, self.frozen, self.global_batch(local), jax.random.fold_in(key, i))
      totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    return {f"eval_{k}": float(v) for k, v in jax.device_get(summarize(totals, self.config.objective)).items()}

  def modules(self):
    """(teacher, student) over the current parameters (teacher None without one), e.g. for logits."""
    return self.models.modules(self.state.params, self.frozen)

  def model(self):
    """The trained module over the current parameters."""
    return self.models.student(self.state.params, self.frozen)

  def export(self, out_dir: str | None = None) -> str | None:
    """The trained model for PyTorch: a PEFT adapter (default <workdir>/adapter) or, after a full fine-tune or
    LoRA on a family PEFT cannot name (LLaDA2: merged into the base), a Hugging Face checkpoint (default
    <workdir>/hf) with the tokenizer of data.tokenizer / the base."""
    out_dir = out_dir or os.path.join(self.workdir, "adapter" if exports_adapter(self.models) else "hf")
    return export_student(out_dir, self.models, self.state.params, base_dir=self.model_path,
                          aux_dir=self.tokenizer_dir, attention=objectives.get(self.config.objective).attention,
                          frozen=self.frozen if self.models.lora is not None else None)

  def run(self, num_steps: int | None = None) -> list[dict]:
    """Train to config.total_steps (or only `num_steps` more, without the final save: a simulated crash).

    Returns the logged metrics, one dict per logged step (each also appended to metrics.jsonl when logged).
    Sets `self.preempted` when a SIGTERM / preemption notice ended it early (after saving its checkpoint);
    raises NonFiniteError, before any save or export of that state, when training diverged."""
    c = self.config
    start = self.step
    end = c.total_steps if num_steps is None else min(c.total_steps, start + num_steps)
    step_fn = compiled_train_step(self.spec, self.mesh, self.rules)
    stop = StopSignal() if jax.process_count() == 1 else None
    positions = 0  # positions trained since the last log (length buckets make a step's length vary)
    history: list[dict] = []
    first_bad = jnp.int32(-1)
    self.preempted = False
    bar = tqdm(total=end, initial=start, desc=c.objective, disable=not (c.progress_bar and self.is_main),
               dynamic_ncols=True)
    if start == 0 and self.eval_data:  # the untrained model: the baseline every later eval compares to
      baseline = self.evaluate()
      self._log(history, 0, baseline)
    last_time = time.perf_counter()
    try:
      for step in range(start + 1, end + 1):
        local = next(self.data)
        positions += c.batch_size * np.shape(local["tokens"])[1]
        self.state, metrics = step_fn(self.state, self.frozen, self.global_batch(local))
        first_bad = divergence.first_bad_step(first_bad, jnp.int32(step), metrics)
        bar.update(1)
        record = {}
        if step % c.log_every == 0 or step == end:
          record = {k: float(v) for k, v in jax.device_get(metrics).items()}
          now = time.perf_counter()
          record["tokens_per_s"] = positions / (now - last_time)
          if self.peak_flops:
            record["mfu"] = record["tokens_per_s"] * self.flops_per_token / (self.peak_flops * jax.device_count())
          last_time, positions = now, 0
          bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                          mfu=f"{record.get('mfu', 0.0):.1%}")
        preempted = (stop is not None and stop.requested) or self.checkpointer.reached_preemption(step)
        save = preempted or step == c.total_steps or self.checkpointer.due(step)
        if record or save:  # one host sync, only where something is written
          self._check_finite(first_bad, step, record, params=save)
        if self.eval_data and (step % c.eval_every == 0 or step == c.total_steps):
          record.update(self.evaluate())
          last_time = time.perf_counter()  # evaluation is not training throughput
        if record:
          self._log(history, step, record)
        if save:
          self.checkpointer.save(step, self.state, self.data.get_state(), force=True)
        if preempted:
          log.warning("stopping at step %d after a preemption notice (checkpoint saved)", step)
          self.preempted = True
          break
      self.checkpointer.wait()
      if self.step == c.total_steps and c.export:
        self._check_finite(first_bad, self.step, {}, params=True)
        self.export()
    finally:
      bar.close()
      self.writer.flush()
      if stop is not None:
        stop.restore()
    return history

  def _log(self, history: list[dict], step: int, record: dict) -> None:
    """Keep one logged step: in the returned history, TensorBoard and metrics.jsonl (appended, flushed)."""
    entry = {"step": step, **record}
    history.append(entry)
    self.writer.scalars(step, record)
    if self.is_main:
      with open(os.path.join(self.workdir, METRICS_FILE), "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()

  def _check_finite(self, first_bad: jax.Array, step: int, record: dict, *, params: bool) -> None:
    """NonFiniteError before anything is logged, saved or exported from a diverged state."""
    divergence.check(first_bad, step, record, self.state.params, check_params=params, lr=self.config.optim.lr,
                     newest_checkpoint=self.checkpointer.latest_step())

  def close(self) -> None:
    try:
      self.checkpointer.wait()
      self.checkpointer.close()
      self.writer.close()
    finally:
      self._release_lock()

  def _release_lock(self) -> None:
    if self._lock is not None:
      workdir_lock.release(self._lock)
      self._lock = None
