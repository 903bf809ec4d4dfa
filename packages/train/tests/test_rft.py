"""Rejection-sampling fine-tuning and best-of-n on the smoke preset's student (2-digit sort).

RFT's weighted batch gives the SFT loss and gradient of its accepted rows alone, for any
microbatch split; a batch with nothing accepted leaves parameters and optimizer state as they
were; the stage runs two rounds and resumes bit for bit from a checkpoint between them. Best-of-1
at the greedy decoding is the greedy evaluation, and best-of-n never beats pass@n."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from bd_core import RolloutOutput
from bd_data import CorruptionConfig, build_canvas
from bd_train import OptimizerConfig, Trainer, TrainerConfig, make_optimizer, rft_batch, sampled_canvas, sft_objective
from bd_train.stages import (
    Run,
    RunDir,
    SimulatedFailure,
    best_of,
    best_of_n,
    choose,
    evaluate,
    parse_pipeline_config,
    run_rft,
    run_sft,
)
from bd_train.stages._evaluate import sampled_correct

SMOKE = Path(__file__).resolve().parents[3] / "flows" / "configs" / "smoke.toml"


def _config(output_dir: Path, **rft) -> dict:
    data = tomllib.loads(SMOKE.read_text())
    data["task"]["params"] = {"length": 2}
    data["sft"].update(steps=30, optim={"lr": 1e-2, "warmup_steps": 2})
    # min_reward 0.1 (partial credit: well formed) keeps some samples of so small a model (about
    # 3 in 16 after 30 SFT steps), where 1.0 would keep none
    data["rft"] = {"steps": 2, "prompts_per_step": 4, "group_size": 4, "updates_per_rollout": 2, "microbatches": 2,
                   "min_reward": 0.1, "optim": {"lr": 1e-3, "warmup_steps": 0}, **rft}
    data["eval"].update(n=8, batch_size=8, samples=4, thresholds=[], best_of=["logprob", "vote"])
    data["run"].update(output_dir=str(output_dir), checkpoint_every=2, max_to_keep=5)
    return parse_pipeline_config(data)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("BDLM_PROGRESS", "0")


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The student's SFT, trained once: the model RFT starts from."""
    root = tmp_path_factory.mktemp("rft")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("BDLM_PROGRESS", "0")
        config = _config(root)
        student = run_sft(config, RunDir.create(config, run_id="sft"), role="student")
    return root, student


def _restore(run: Run, directory: str):
    return run.restore_model(directory, run.model_config("student"), run.identity("student"), what=directory)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# -- the batch --------------------------------------------------------------------------------------

def _rollout(run: Run) -> RolloutOutput:
    """Eight hand-made completions of two blocks of 4: stops in either block, text after the stop,
    a row that never stops, an empty answer."""
    tok = run.tokenizer
    prompts = next(run.prompts("rft", 8))
    e = tok.eos_id
    texts = [b"12", b"0123", b"01234567", b"", b"9", b"345", b"77", b"1"]
    after = [b"", b"5", b"", b"12", b"", b"", b"8", b"777"]
    tokens, valid = np.full((8, 8), tok.pad_id, np.int32), np.zeros((8, 8), bool)
    for i, (text, tail) in enumerate(zip(texts, after)):
        ids = list(tok.encode(text.decode())) + ([e] if len(text) < 8 else []) + list(tok.encode(tail.decode()))
        ids = ids[:8]
        blocks = -(-len(ids) // 4) * 4
        tokens[i, :len(ids)], valid[i, :blocks] = ids, True
        tokens[i, len(ids):blocks] = tok.encode("4")[0]  # whatever the sampler left in the stop block
    return RolloutOutput(prompts.tokens, prompts.valid, tokens, valid, np.ones(8, np.int32))


def test_sampled_completions_are_laid_out_as_sft_lays_out_answers(tmp_path):
    run = Run(_config(tmp_path))
    rollout = _rollout(run)
    canvas = sampled_canvas(rollout, block_size=4, eos_id=run.tokenizer.eos_id, pad_id=run.tokenizer.pad_id)
    for i, answer in enumerate(["12", "0123", None, "", "9", "345", "77", "1"]):
        if answer is None:  # no stop: every generated token, no eos appended
            assert canvas.valid[i, 8:].all() and (canvas.tokens[i, 8:] == rollout.completion_tokens[i]).all()
            continue
        prompt = rollout.prompt_tokens[i][rollout.prompt_valid[i]]
        expected = build_canvas(prompt, run.tokenizer.encode(answer), run.config.canvas, run.tokenizer)
        for field in dataclasses.fields(expected):
            np.testing.assert_array_equal(getattr(canvas, field.name)[i], getattr(expected, field.name))


def test_the_loss_and_gradient_are_the_sft_ones_of_the_accepted_rows_for_any_microbatch_split(tmp_path, toy_model):
    run = Run(_config(tmp_path))
    rollout, corruption = _rollout(run), CorruptionConfig()
    accepted = np.array([1, 0, 0, 1, 1, 0, 0, 0], bool)  # split in 4 interleaved parts, two accept nothing
    make = lambda rows: rft_batch(rollout, rows, canvas=run.config.canvas, corruption=corruption,  # noqa: E731
                                  tokenizer=run.tokenizer, rng=np.random.default_rng(7))
    weighted, every = make(accepted), make(np.ones(8, bool))
    only = jax.tree.map(lambda x: np.asarray(x)[accepted], every)  # the same masks, rejected rows gone
    model = toy_model(run.tokenizer.vocab_size, key=jax.random.key(0))
    sgd = optax.sgd(1.0)  # the new parameters are the old minus the gradient
    init = lambda: Trainer(sft_objective, sgd).init(model, key=jax.random.key(1))  # noqa: E731
    reference, ref = Trainer(sft_objective, sgd).step(init(), only)
    assert float(ref["loss"]) > 0
    for k in (1, 4):
        state, metrics = Trainer(sft_objective, sgd, TrainerConfig(microbatches=k)).step(init(), weighted)
        for key in ("loss", "ce", "token_accuracy"):
            assert abs(float(metrics[key]) - float(ref[key])) <= 1e-6, (k, key)
        for a, b in zip(_leaves(state.params), _leaves(reference.params)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_nothing_accepted_leaves_parameters_and_optimizer_state_unchanged(tmp_path, toy_model):
    run = Run(_config(tmp_path))
    batch = rft_batch(_rollout(run), np.zeros(8, bool), canvas=run.config.canvas, corruption=CorruptionConfig(),
                      tokenizer=run.tokenizer, rng=np.random.default_rng(0))
    # weight decay and Adam's moments would move both under an applied zero-gradient update
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, weight_decay=0.1))
    trainer = Trainer(sft_objective, optimizer, TrainerConfig(microbatches=2))
    state = trainer.init(toy_model(run.tokenizer.vocab_size, key=jax.random.key(0)), key=jax.random.key(1))
    after, metrics = trainer.step(state, batch)
    assert float(metrics["update_applied"]) == 0.0 and float(metrics["loss"]) == 0.0
    assert int(after.step) == int(state.step) + 1 and float(metrics["nonfinite"]) == 0.0
    for a, b in zip(_leaves((after.params, after.opt_state)), _leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(a, b)


# -- the stage --------------------------------------------------------------------------------------

def test_two_rounds_resume_bit_for_bit(start):
    root, student = start
    config = _config(root)
    through = run_rft(config, RunDir.create(config, run_id="through"), start=student)
    broken = RunDir.create(config, run_id="broken")
    with pytest.raises(SimulatedFailure):
        run_rft(config, broken, start=student, fail_after=2)  # after round 1 (two updates), saved
    resumed = run_rft(config, broken, start=student)
    assert [r["step"] for r in through.history] == [2, 4]
    assert resumed.history == through.history
    for row in through.history:
        assert {"accepted", "reward_mean", "loss", "grad_norm"} <= set(row)
        assert row["update_applied"] == float(row["accepted"] > 0)  # a round that accepts nothing applies nothing
    run = Run(config)
    final = _leaves(_restore(run, through.checkpoint_dir))
    for a, b in zip(_leaves(_restore(run, resumed.checkpoint_dir)), final):
        np.testing.assert_array_equal(a, b)
    trained = any(r["accepted"] > 0 for r in through.history)
    assert trained != all(np.array_equal(a, b) for a, b in zip(final, _leaves(_restore(run, student.checkpoint_dir))))
    assert resumed.evaluation.metrics() == through.evaluation.metrics()
    assert {"best_of@4_logprob", "best_of@4_vote", "nfe_per_problem@4"} <= set(through.evaluation.metrics())



# -- best-of-n --------------------------------------------------------------------------------------

def test_the_rules_choose_without_the_reference():
    texts = [["12", "21", "12 ", "33"], ["a", "b", "c", "d"], ["x", "y", "y", "x"]]
    logprobs = np.array([[-1.0, -0.5, -3.0, -0.1], [-2.0, -1.0, -1.0, -4.0], [-1.0, -2.0, -0.5, -3.0]])
    np.testing.assert_array_equal(choose(texts, logprobs, "logprob"), [3, 1, 2])
    # "12" twice (stripped); all distinct: the most confident; x and y tie: y's best sample is more confident
    np.testing.assert_array_equal(choose(texts, logprobs, "vote"), [0, 1, 2])


def test_best_of_n_is_at_most_pass_at_n_and_best_of_one_is_the_sample():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5):
        rewards = rng.choice([0.0, 0.1, 1.0], size=(50, n))
        texts = [str(rng.integers(3)) for _ in range(50 * n)]
        for b in best_of_n(rewards, texts, rng.normal(size=(50, n)), rng.integers(1, 9, (50, n)), ("logprob", "vote")):
            assert b.accuracy <= b.pass_at_n == np.mean((rewards == 1.0).any(axis=1))
            if n == 1:
                assert b.accuracy == np.mean(rewards == 1.0) and b.mean_reward == rewards.mean()


def test_best_of_on_the_model(start):
    root, student = start
    run = Run(_config(root))
    model = _restore(run, student.checkpoint_dir)
    key = jax.random.key(3)
    greedy = evaluate(model, run, key=key)
    (one,) = best_of(model, run, 1, ("logprob",), key=key, sampler=run.config.eval.sampler)
    assert (one.accuracy, one.mean_reward) == (greedy.accuracy, greedy.mean_reward)
    assert one.nfe_per_problem == pytest.approx(greedy.nfe_per_token * greedy.generated_tokens, rel=1e-12)
    four = best_of(model, run, 4, key=key)
    correct = sampled_correct(model, run, 4, key=key)  # pass@k's samples: the same rollouts
    for b in four:
        assert b.pass_at_n == np.mean(correct > 0) and b.accuracy <= b.pass_at_n
        assert all(c > 0 for c, chosen in zip(correct, b.correct) if chosen)
    assert student.evaluation.best_of and all(b.n == 4 for b in student.evaluation.best_of)
