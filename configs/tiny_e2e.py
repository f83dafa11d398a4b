r"""The miniature D2F reproduction that `python -m d2f_jax.main` runs by default (12 min measured on 2 CPU cores).

The recipe of Dream-7B + D2F in miniature, on the built-in arithmetic task:
  1. AR pre-training: a Dream-layout (Qwen2-style) model learns the task causally. It is also the AR baseline.
  2. MDM adaptation: the AR weights are adapted to masked diffusion with shifted logits (Dream's recipe:
     row i - 1 predicts token i, the convention the AR model already has); this is the teacher.
  3. D2F distillation: the student learns block-causal parallel decoding from the teacher.
Optionally (`llada_teacher.steps > 0`) a LLaDA-layout teacher is also trained from scratch with the
masked-diffusion objective, as a second teacher row.

  python -m d2f_jax.main                                   # this config, workdir ./workdir/tiny_e2e
  python -m d2f_jax.main --config configs/tiny_e2e.py:smoke --workdir /tmp/e2e   # a minute, for tests
  python -m d2f_jax.main --config configs/tiny_e2e.py:long --workdir workdir/tiny_e2e_long   # long answers
  python -m d2f_jax.main --config configs/tiny_e2e.py:long,smoke --workdir /tmp/e2e_long    # its smoke check

`long`: the authors' shapes in miniature: verbose worked solutions of 4-7 operations (the 64 held-out answers
average 136 tokens, the longest 193), distilled at block 16 and decoded at block 32 with up to 256 new
tokens, so a D2F decode pipelines over many blocks.
"""

import ml_collections

from d2f_jax.train.config import parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, smoke=False, llada=False, long=False)
  c = ml_collections.ConfigDict()
  c.seed = 0
  # Training problems are drawn from the generator (the held-out ones are never among them); the held-out
  # set is what `python -m d2f_jax.evaluate --task arithmetic` scores (d2f_jax.tasks.arithmetic defaults).
  # style: the worked solution's format (d2f_jax.tasks.arithmetic.STYLES); terse is the default run's.
  c.task = ml_collections.ConfigDict(dict(train=30000, test=256, min_steps=1, max_steps=2, style="terse"))
  c.seq_len = 80
  # Length-bucketed training batches (d2f_jax/train/buckets.py): each batch cut to the shortest of these (or
  # seq_len) its rows fit in. (): every batch is seq_len long.
  c.length_buckets = ()
  c.model = ml_collections.ConfigDict(dict(embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
                                           mlp_dim=384, rope_theta=10_000.0, norm_eps=1e-6))
  c.batch_size = 32
  # Stage lengths in optimizer steps; learning rates are toy-scale (tiny model). The AR stage keeps a constant
  # rate (warmup-stable, no decay), the MDM and D2F stages decay to 0 (cosine). Measured: from the 1200-step
  # constant-rate AR model, 700 MDM steps constant 45.3 % -> cosine 62.5 %, 1400 cosine 71.9 % (2100: 70.3 %) teacher
  # exact match; from an 800-step cosine-annealed AR model (96.1 % itself) 1300 cosine MDM steps reach only 27.7 %:
  # the annealed model adapts badly, so the teacher starts from the un-annealed one; from a 700-step constant-rate
  # AR model the teacher reaches 34.4 %.
  c.ar = ml_collections.ConfigDict(dict(steps=1200, lr=2e-3, warmup=60, decay="constant"))
  # semi_ar: the fraction of the teacher's MDM rows noised as a semi-AR decode's states (train/loss_mdm.py);
  # suffix_weight: the loss weight of those rows' all-masked suffix after the window (0: the window's alone);
  # ar_weight: adds this times the AR loss of the clean rows, a causal pass of the same weights (0: MDM alone).
  c.teacher = ml_collections.ConfigDict(dict(steps=1400, lr=1e-3, warmup=30, decay="cosine", semi_ar=0.0,
                                             suffix_weight=1.0, ar_weight=0.0))
  c.student = ml_collections.ConfigDict(dict(steps=400, lr=5e-4, warmup=20, finetune="full", lora_rank=32,
                                               decay="cosine"))
  c.llada_teacher = ml_collections.ConfigDict(dict(steps=0, lr=2e-3, warmup=60, decay="cosine"))  # 0: skipped
  c.block_size = 8  # the distillation block (training); decoding too unless decode_block_size is set
  # The block every decoder runs at; None: block_size (an int reference, so --config.decode_block_size=32 works).
  c.decode_block_size = ml_collections.FieldReference(None, field_type=int)
  c.max_new_tokens = 40  # longest solution (39 tokens + EOS) in whole blocks; a multiple of the decode block
  # D2F threshold sweep: (tau_add, tau_act, tau_conf); the first is the paper's default.
  c.d2f_sweep = [(0.1, 0.95, 0.9), (0.3, 0.9, 0.8), (0.5, 0.9, 0.7)]
  # Throughput modes of the student at the paper's thresholds, (decode block, query_limit) with None = the
  # default's (decode/query_window.py): extra rows after the d2f sweep. None here: the default run's table.
  c.mode_sweep = []
  c.threshold_tau_conf = 0.9
  c.max_blocks_in_flight = 0  # 0: no cap (the authors' loop); a cap is a speed option only
  c.eval_batch_size = 1  # the paper's setting
  # A finished stage is reused only with the config it ran with; "student" (or "ar,teacher", "all") moves the
  # named stages' directories aside and trains them again (python -m d2f_jax.main --config.rerun=student).
  c.rerun = ""
  if arg.llada:
    c.llada_teacher.steps = 1800
  if arg.long:
    _long(c)
  if arg.smoke:
    c.task.update(dict(train=256, test=4))
    c.ar.steps, c.teacher.steps, c.student.steps = 4, 4, 4
    c.ar.warmup = c.teacher.warmup = c.student.warmup = 1  # a decaying stage needs more steps than warm-up
    c.llada_teacher.steps = 0
    c.batch_size = 8
    c.d2f_sweep = [(0.1, 0.95, 0.9), (0.5, 0.9, 0.7)]
    if arg.long:  # two decode blocks and two problems: vanilla runs every step of the untrained models
      c.max_new_tokens, c.task.test = 64, 2
      c.mode_sweep = [(None, 4), (16, 4), (None, 4, True)]
  return c


def _long(c: ml_collections.ConfigDict) -> None:
  """The long-answer variant (module docstring). Measured from scratch on 2 CPU cores (a niced package
  install beside it for its first 15 minutes): AR 2400 steps 671 s, teacher 3000 steps 1594 s (two passes a
  step: ar_weight), student 800 steps 309 s: 43 min of training on length-bucketed batches (a step computes
  ~202 positions a row instead of 304; whole rows took ~67 min), evaluation of the 14 rows and the timing
  pass 24 min. Results (results/tiny_e2e_long/): AR 67.2 %, the teacher 25.0 % decoded semi-AR one token a
  step and 12.5 % with the threshold decoder, the D2F student 46.9 % at the paper's thresholds and 54.7 % at
  its training block 16. semi_ar 0.5 made the teacher's answers well formed (they ran past the last step and
  never stopped with iid masks alone); ar_weight 1 kept the AR model's arithmetic, which the MDM adaptation
  alone lost (teacher 0-1.6 %, docs/main_job.md)."""
  c.task.update(dict(min_steps=4, max_steps=7, style="verbose", test=64))
  c.seq_len = 304  # the longest training row is 298 tokens (prompt + solution + EOS)
  c.length_buckets = (160, 192, 224, 256)  # rows use 185 of the 304 positions on average; batches ~202
  c.batch_size = 8  # 8 rows of about 185 tokens: the default's 32 x 49 tokens per step
  c.block_size, c.decode_block_size, c.max_new_tokens = 16, 32, 256  # the authors' training / decoding blocks
  # (decode block or None, query limit or None[, cache_decided]): sub-blocks of 8 / 4; the training block; the
  # approximate cache of decided positions alone and with sub-blocks.
  c.mode_sweep = [(None, 8), (None, 4), (16, None), (16, 4), (None, None, True), (None, 8, True), (None, 4, True)]
  c.ar.steps, c.student.steps = 2400, 800
  c.teacher.update(dict(steps=3000, semi_ar=0.5, ar_weight=1.0))
