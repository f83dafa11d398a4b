"""`python -m d2f_jax.generate` on a tiny synthetic Hugging Face checkpoint."""

import pytest

from d2f_jax.models import TINY_DREAM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  synthetic = pytest.importorskip("d2f_jax.convert.synthetic")
  return synthetic.write_hf_checkpoint(tmp_path_factory.mktemp("tiny_dream"), TINY_DREAM, seed=0, dtype="float32")


def test_cli_streams_and_matches_the_jitted_loop(checkpoint, capsys):
  import d2f_jax
  from d2f_jax import generate as cli
  from d2f_jax.decode import DecodeConfig, generate

  flags = ["--model", checkpoint, "--block_size", "4", "--max_new_tokens", "16", "--tau_conf", "0.05",
           "--max_blocks_in_flight", "2"]
  streamed = cli.main(flags + ["--prompt", "w5 w6 w7", "--chat"])
  out = capsys.readouterr()
  assert "tokens/forward" in out.err and streamed["tokens"] > 0
  assert 0 < streamed["forwards"] <= 16

  once = cli.main(flags + ["--prompt_ids", "5,6,7", "--no_stream"])
  text = capsys.readouterr().out.rstrip()
  model = d2f_jax.load_model(checkpoint)
  config = DecodeConfig(block_size=4, max_new_tokens=16, tau_conf=0.05, max_blocks_in_flight=2)
  ids = generate(model, [[5, 6, 7]], config).to_lists()[0]
  # endswith: the tokenizer loader may print a notice on stdout before the generated text
  assert text.endswith(model.tokenizer.decode(ids, skip_special_tokens=True))
  assert once["tokens"] == len(ids)


def test_cli_rejects_bad_options(checkpoint, capsys):
  from d2f_jax import generate as cli
  with pytest.raises(SystemExit, match="multiple of block_size"):
    cli.main(["--model", checkpoint, "--prompt_ids", "1", "--block_size", "3", "--max_new_tokens", "16"])
  with pytest.raises(SystemExit) as stop:  # more bad requests in test_decode_limits.py
    cli.main(["--model", checkpoint, "--prompt_ids", "1,x"])
  assert stop.value.code == 2 and "error: --prompt_ids must be comma-separated" in capsys.readouterr().err


def test_cli_device_flags(checkpoint, capsys):
  from d2f_jax import generate as cli
  from d2f_jax.sharding import parse_mesh

  assert parse_mesh("data=2, tensor=4") == {"data": 2, "tensor": 4}
  assert parse_mesh("fsdp=-1") == {"fsdp": -1}
  for bad, message in (("model=2", "axes data, fsdp, tensor"), ("data=x", "must be an int"),
                       ("data=0", "positive or -1"), ("data=2,data=2", "given twice"), (",", "no axis")):
    with pytest.raises(ValueError, match=message):
      parse_mesh(bad)
  flags = ["--model", checkpoint, "--prompt_ids", "5,6,7", "--block_size", "4", "--max_new_tokens", "8",
           "--no_stream", "--distributed", "off"]
  with pytest.raises(SystemExit, match="--mesh data=2: .*needs 2 devices, found 1"):
    cli.main(flags + ["--mesh", "data=2"])
  with pytest.raises(SystemExit):
    cli.main(flags + ["--attention", "triton"])
  capsys.readouterr()
  plain = cli.main(flags + ["--attention", "xla"])
  on_mesh = cli.main(flags + ["--mesh", "tensor=-1"])  # the whole (one-device) machine as a mesh
  assert "on mesh {'data': 1, 'fsdp': 1, 'tensor': 1}" in capsys.readouterr().err
  assert (plain["tokens"], plain["forwards"]) == (on_mesh["tokens"], on_mesh["forwards"])
  # --layer_loop reaches the model: the scanned cached forward decodes the same text as the unrolled one.
  with pytest.raises(SystemExit):
    cli.main(flags + ["--layer_loop", "fori"])
  capsys.readouterr()
  cli.main(flags + ["--attention", "xla"])
  unrolled_text = capsys.readouterr().out
  scanned = cli.main(flags + ["--attention", "xla", "--layer_loop", "scan"])
  assert capsys.readouterr().out == unrolled_text
  assert (scanned["tokens"], scanned["forwards"]) == (plain["tokens"], plain["forwards"])
  from d2f_jax.api import load_from_flags
  assert load_from_flags(cli.build_parser().parse_args(flags + ["--layer_loop", "scan"])).config.layer_loop == "scan"
