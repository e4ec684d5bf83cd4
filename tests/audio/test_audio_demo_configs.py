"""The shipped CPU audio demo (configs/tiny/audio_sft then audio_grpo) runs as shipped through
the CLI in-process, shrunk by command-line overrides only: the prepare steps write the tiny model
and the tone clips, the SFT export feeds the GRPO step, which evaluates at start and end."""

from lightrft import cli
from lightrft.training import read_metrics


def test_shipped_audio_demo_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the configs write under ./outputs
    sft = [
        "max_steps=2",
        "batch_size=8",
        "lr_scheduler.warmup_steps=0",
        "prepare.1.n_train=16",
        "prepare.1.n_rl=8",
        "prepare.1.n_test=8",
        "eval_every=null",
    ]
    assert cli.main(["run", "sft", "--config", "tiny/audio_sft", *sft]) == 0
    final = tmp_path / "outputs/tiny/audio_sft/final"
    assert (final / "processor_config.json").is_file()
    grpo = ["max_steps=1", "lr_scheduler.warmup_steps=0", "rollout.prompts_per_step=2"]
    assert cli.main(["run", "grpo", "--config", "tiny/audio_grpo", *grpo]) == 0
    rows = read_metrics(tmp_path / "outputs/tiny/audio_grpo")
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert sorted(evals) == [0, 1] and all(0 <= a <= 1 for a in evals.values())
    train = [r for r in rows if "train/lr" in r]
    assert train and train[0]["rollout/samples"] == 16  # 2 prompts x 8 samples
