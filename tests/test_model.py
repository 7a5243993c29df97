"""The network, packed batches, the schedule, checkpoints and the planner (no training run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from infra.errors import DataError
from infra.recipe import ModelCfg, load_recipe, parse_recipe
from model.checkpoint import MARKER, CheckpointStore, is_complete
from model.config import Schedule
from model.data import IGNORE, MixtureBatches, TokenSource, sample_order
from model.network import Arch, build_model, load_model, long_context_config, model_config, with_yarn
from model.plan import count_params, gpus_needed, plan
from model.train import _LMLoss, lm_loss
from tasks.pretrain import train_configs
from tests.helpers import REPO, micro_recipe

TINY = ModelCfg(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


# Run in a fresh interpreter: in a pytest worker, after other test files had run there, the weights once differed
# (`make test`, 2026-12-07), while the test passed alone, and after a test that fine-tunes a model in-process (vllm_sft).
# transformers' init patches (`no_init_weights`, `guard_torch_init_functions`) are process-wide, so what earlier
# tests leave in the process must not decide this comparison.
AGAINST_TRANSFORMERS = """
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, SmolLM3Config, SmolLM3ForCausalLM

from infra.recipe import ModelCfg
from model.network import build_model, load_model, model_config, save_pretrained, with_yarn

out, TINY = Path(sys.argv[1]), ModelCfg.model_validate_json(sys.argv[2])
for tie, pad in ((True, None), (False, 3)):
    arch = TINY.model_copy(update={"tie_word_embeddings": tie})
    config = model_config(arch, 300, 128, special_ids={"eos_token_id": 2, "pad_token_id": pad})
    ours = build_model(config, seed=5)
    torch.manual_seed(5)
    theirs = SmolLM3ForCausalLM(SmolLM3Config(**config.to_hf() | {"use_cache": False}))  # with a cache it packs nothing
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    differ = [k for k, v in theirs.state_dict().items() if not torch.equal(ours.state_dict()[k], v)]
    assert not differ, f"tie={tie}: other weights from the same seed: {differ}"
    ids = torch.randint(0, 300, (3, 40))
    for positions in (torch.cat([torch.arange(15), torch.arange(25)]).repeat(3, 1), None):
        a, b = ours(input_ids=ids, position_ids=positions).logits, theirs(input_ids=ids, position_ids=positions).logits
        assert torch.equal(a, b), f"tie={tie}, packed={positions is not None}: other logits"
        ours.zero_grad(), theirs.zero_grad()
        a.square().mean().backward(), b.square().mean().backward()
        grads = dict(theirs.named_parameters())
        differ = [n for n, q in ours.named_parameters() if not torch.equal(q.grad, grads[n].grad)]
        assert not differ, f"tie={tie}, packed={positions is not None}: other gradients: {differ}"
    save_pretrained(ours, out / str(tie), config=with_yarn(config, 2.0))
    loaded = AutoModelForCausalLM.from_pretrained(out / str(tie))
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in loaded.state_dict().items()), "transformers loads other weights"
    expected = SmolLM3Config(**with_yarn(config, 2.0).to_hf()).to_dict()
    assert AutoConfig.from_pretrained(out / str(tie)).to_dict() | {"_name_or_path": ""} == expected
    assert loaded.generation_config.use_cache and loaded.generation_config.eos_token_id == 2
    again = load_model(out / str(tie), config)  # its own config asks for YaRN, below
    assert (again.lm_head.weight is again.model.embed_tokens.weight) == tie
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in again.state_dict().items()), "load_model reads other weights"
"""


def test_the_network_is_transformers_smollm3_bit_for_bit_and_saves_a_checkpoint_transformers_loads(tmp_path):
    """Same seed, same weights; same logits and gradients on packed and plain rows; save_pretrained's folder loads in
    transformers as the same model and config, and back in load_model; a config it cannot compute is refused."""
    command = [sys.executable, "-c", AGAINST_TRANSFORMERS, str(tmp_path), TINY.model_dump_json()]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    data = json.loads((tmp_path / "True" / "config.json").read_text()) | {"hidden_act": "gelu"}
    with pytest.raises(DataError, match=r"config.json: hidden_act = 'gelu'"):
        Arch.from_hf(data, tmp_path / "True" / "config.json")
    with pytest.raises(DataError, match="rope_type 'yarn'"):  # what it saved for inference engines, it does not train
        load_model(tmp_path / "True")


def write_source(folder: Path, docs: list[list[int]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.array([t for d in docs for t in d], dtype=np.uint16).tofile(folder / "s.ds")
    np.cumsum([len(d) for d in docs]).astype(np.uint64).tofile(folder / "s.ds.index")
    (folder / "s.ds.metadata").write_text("tokenizer.json|2\n0\n0")
    return folder


def test_architecture_is_smollm3_with_nope_layers():
    config = model_config(TINY, vocab_size=300, max_positions=128)
    model = build_model(config, seed=0)
    assert config.to_hf()["model_type"] == "smollm3" and config.no_rope_layers == [1, 1, 1, 0]
    assert count_params(config) == sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(build_model(config, 0).model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_packed_documents_do_not_see_each_other(tmp_path):
    """Changing one document of a packed sequence leaves the other documents' logits unchanged."""
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, 300, n)) for n in (9, 14, 7, 12)]
    changed = [d[:] for d in docs]
    changed[1] = list(rng.integers(0, 300, 14))
    model = build_model(model_config(TINY, 300, 64), seed=0).eval()
    outs = []
    for i, variant in enumerate((docs, changed)):
        source = TokenSource(write_source(tmp_path / f"v{i}", variant))
        batch = MixtureBatches.collate([source.window(0, 42)])
        with torch.no_grad():
            outs.append(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0])
        assert batch["position_ids"][0].tolist()[:11] == [*range(9), 0, 1]
        assert (batch["labels"][0][[0, 9, 23, 30]] == IGNORE).all()
    doc1 = slice(9, 23)
    others = torch.ones(42, dtype=torch.bool)
    others[doc1] = False
    assert torch.allclose(outs[0][others], outs[1][others], atol=1e-5)
    assert not torch.allclose(outs[0][doc1], outs[1][doc1], atol=1e-3)
    # the same sequence without its position ids attends across documents: the mask comes from them
    batch = MixtureBatches.collate([TokenSource(tmp_path / "v1").window(0, 42)])
    with torch.no_grad():
        crossed = model(input_ids=batch["input_ids"]).logits[0]
    assert not torch.allclose(crossed[others], outs[1][others], atol=1e-3)


def test_batches_are_a_pure_function_of_the_step_and_follow_the_mixture(tmp_path):
    sources = [TokenSource(write_source(tmp_path / n, [list(range(k, k + 50))] * 4)) for n, k in (("a", 0), ("b", 100))]
    order = sample_order([30, 10], seed=3, phase_index=1)
    assert np.bincount(order.source_of).tolist() == [30, 10]
    batches = MixtureBatches(sources, order, seq_len=16, micro_batch=2, batch_size=8)
    assert batches.steps == 5
    again = MixtureBatches(sources, sample_order([30, 10], seed=3, phase_index=1), 16, 2, 8)
    for step in range(batches.steps):
        for rank in range(2):
            a, b = batches.micro_batches(step, rank, 2), again.micro_batches(step, rank, 2)
            assert len(a) == 2 and all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    seen = torch.cat([mb["input_ids"] for s in range(5) for r in range(2) for mb in batches.micro_batches(s, r, 2)])
    assert ((seen[:, 0] >= 100).sum().item(), (seen[:, 0] < 100).sum().item()) == (10, 30)
    # one rank with micro-batch 4 sees exactly the samples two ranks of micro-batch 2 see at each step
    for step in range(batches.steps):
        one = torch.cat([mb["input_ids"] for mb in MixtureBatches(sources, order, 16, 4, 8).micro_batches(step, 0, 1)])
        two = torch.cat([mb["input_ids"] for r in range(2) for mb in batches.micro_batches(step, r, 2)])
        assert torch.equal(one, two)


def test_lm_loss_equals_cross_entropy_plus_z_loss_in_value_and_gradient():
    """The fused loss must train exactly what the textbook one does: shifted targets, -100 ignored."""
    torch.manual_seed(0)
    logits = torch.randn(3, 17, 50) * 4
    labels = torch.randint(0, 50, (3, 17))
    labels[0, :6] = IGNORE  # a prompt that is not trained on
    labels[2, 9:] = IGNORE  # and padding
    for z_loss in (0.0, 1e-4, 0.5):
        ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        total, ce = lm_loss(ours, labels, z_loss)
        (2.5 * total).backward()
        shifted, targets = theirs[:, :-1], labels[:, 1:]
        ce_ref = torch.nn.functional.cross_entropy(shifted.reshape(-1, 50), targets.reshape(-1), ignore_index=IGNORE)
        total_ref = ce_ref + z_loss * (torch.logsumexp(shifted, -1)[targets != IGNORE] ** 2).mean()
        (2.5 * total_ref).backward()
        torch.testing.assert_close(total, total_ref.detach())
        torch.testing.assert_close(ce, ce_ref.detach())
        torch.testing.assert_close(ours.grad, theirs.grad)
        assert (ours.grad[:, -1] == 0).all() and (ours.grad[0, :5] == 0).all()  # no target, no gradient
    small = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)  # the hand-written backward, numerically
    targets = torch.where(labels[:2, :5] == IGNORE, IGNORE, labels[:2, :5] % 7)
    assert torch.autograd.gradcheck(lambda t: _LMLoss.apply(t, targets, 0.3)[0], (small,))


def test_warmup_stable_decay_schedule():
    schedule = Schedule(steps=100, total=100, warmup=10, decay_start=80, peak=1.0, floor=0.1)
    lrs = [schedule.lr(s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert set(lrs[10:80]) == {1.0}
    assert lrs[80] < 1.0 and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:]))
    # the schedule is global: the recipe's phases continue it, the long-context phase runs at a constant rate
    data = micro_recipe(**{"pretrain.optimizer.warmup_steps": 3, "pretrain.optimizer.decay_fraction": 0.2})
    phases = [c.schedule for c in train_configs(parse_recipe(data, "m"))]
    assert [s.offset for s in phases] == [0, 31, 38, 45] and phases[0].total == 45 and phases[0].decay_start == 36
    assert phases[1].lr(0) == phases[0].peak and phases[2].lr(phases[2].steps - 1) == pytest.approx(phases[0].floor)
    assert phases[3].constant is not None and phases[3].lr(0) == phases[3].lr(7)


def test_long_context_config_and_yarn():
    base = model_config(TINY, 300, 256)
    long = long_context_config(base, 1024, rope_theta=1e5)
    assert long.max_position_embeddings == 1024 and long.rope_parameters["rope_theta"] == 1e5
    assert long.no_rope_layers == base.no_rope_layers
    yarn = with_yarn(long, 2.0)
    assert yarn.max_position_embeddings == 2048
    assert yarn.rope_parameters["rope_type"] == "yarn" and yarn.rope_parameters["original_max_position_embeddings"] == 1024


def fake_checkpoint(store: CheckpointStore, step: int, payload: bytes = b"x" * 100) -> None:
    tag = f"step{step:08d}"
    staged = store.tmp_dir() / tag
    (staged / "shards").mkdir(parents=True)
    (staged / "shards" / "optim.pt").write_bytes(payload)
    store.commit(tag, step, {})


def test_torn_checkpoint_is_never_loaded(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    fake_checkpoint(store, 10)
    fake_checkpoint(store, 20)
    # a save killed midway: files staged but never committed, and a folder whose shard lost bytes
    assert not store.tmp_dir().exists()  # each commit leaves no empty staging folder behind
    (store.tmp_dir() / "step00000030").mkdir(parents=True)
    (tmp_path / "step00000020" / "shards" / "optim.pt").write_bytes(b"x" * 10)
    assert not is_complete(tmp_path / "step00000020")
    assert store.latest() == "step00000010"


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        fake_checkpoint(store, step)
    assert store.local_tags() == ["step00000003", "step00000004"]
    assert json.loads((tmp_path / "latest.json").read_text())["tag"] == "step00000004"


@pytest.mark.slow
def test_checkpoints_mirror_to_s3_and_come_back(tmp_path, s3_server):
    import s3fs

    from infra.recipe import S3Cfg
    from infra.storage import Mirror

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server["endpoint"]})
    fs.mkdir("ckpt-bucket")
    mirror = Mirror("s3://ckpt-bucket/run", S3Cfg(endpoint_url=s3_server["endpoint"]), backoff_s=0.1)
    store = CheckpointStore(tmp_path / "a", keep_last=1, mirror=mirror, remote_name="checkpoints/stage1")
    for step in (5, 10):
        fake_checkpoint(store, step)
    assert store.close() == []
    assert fs.exists(f"ckpt-bucket/run/checkpoints/stage1/step00000010/{MARKER}")
    assert store.local_tags() == ["step00000010"]  # the older one went only after its upload was verified

    # the newest checkpoint is not on this machine: resume pulls it back from S3
    fresh = CheckpointStore(tmp_path / "b", keep_last=1, mirror=mirror, remote_name="checkpoints/stage1")
    assert fresh.latest() == "step00000010" and is_complete(tmp_path / "b" / "step00000010")
    fresh.close()

    # an S3 outage: uploads fail, every local copy is kept
    down = Mirror("s3://ckpt-bucket/run", S3Cfg(endpoint_url="http://127.0.0.1:9"), attempts=2, backoff_s=0.01)
    offline = CheckpointStore(tmp_path / "c", keep_last=1, mirror=down, remote_name="checkpoints/stage2")
    fake_checkpoint(offline, 1)
    fake_checkpoint(offline, 2)
    assert offline.close() == ["step00000001", "step00000002"]
    assert offline.local_tags() == ["step00000001", "step00000002"]


def test_planner_matches_the_playbook():
    # 3B parameters, 11T tokens, 30% MFU of 720 TFLOP/s, 4 weeks
    assert round(gpus_needed(6 * 3e9 * 11e12, 720e12, 0.3, 28 * 86400)) == 379
    r = load_recipe(REPO / "configs" / "smollm3-3b.yaml")
    result = plan(r.model, r.pretrain, r.model.vocab_size)
    assert result.gpus == 384 and 3.0e9 < result.params < 3.1e9
    stage1 = result.phases[0]
    assert stage1.global_batch_tokens == 192 * 3 * 4096 == 2_359_296 and not stage1.problems


def test_planner_flags_bad_plans():
    data = micro_recipe(**{"pretrain.parallel": {"dp": 3}, "pretrain.hardware": {"memory_gb": 0.001}})
    r = parse_recipe(data, "m")
    problems = plan(r.model, r.pretrain, 512).phases[0].problems
    assert any("batch_size 4 is not a multiple of DP 3 x micro-batch 4" in p for p in problems)
    assert any("GiB per GPU with ZeRO-0" in p for p in problems)


def test_slurm_batch_script_of_the_3b_recipe_requeues_and_starts_every_rank(tmp_path):
    import subprocess

    from infra.slurm import batch_script

    launcher = load_recipe(REPO / "configs" / "smollm3-3b.yaml").pretrain.launcher
    script = batch_script(launcher, "smolflow-stage1", tmp_path / "job.log", "model.train", [str(tmp_path / "job.json")], tmp_path)
    for directive in ("--requeue", "--nodes=48", "--ntasks-per-node=8", "--gpus-per-node=8", "--signal=USR1@600", "--exclusive"):
        assert f"#SBATCH {directive}\n" in script, directive
    launch = script[script.index("\nsrun ") : script.index("\ncode=$?")]
    assert "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in launch
    assert "exec" in launch and "-m model.train" in launch
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script and "GLOO_SOCKET_IFNAME" not in script  # 48 nodes: not loopback
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid bash


class Payload:
    """Stands for an arbitrary object someone pickled into a checkpoint file."""


def test_checkpoint_files_load_weights_only(tmp_path):
    import pickle
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from model.checkpoint import weights_only_engine

    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    weights_only_engine(engine)
    torch.save({"module": {"w": torch.ones(2)}, "step": 3}, tmp_path / "ok.pt")
    assert engine.checkpoint_engine.load(str(tmp_path / "ok.pt"))["step"] == 3
    torch.save({"module": {}, "extra": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        engine.checkpoint_engine.load(str(tmp_path / "evil.pt"))
