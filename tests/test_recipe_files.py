"""--config FILE: a recipe of flag values (YAML or JSON) under the command line's, and the args.yaml every run
writes beside its history, which trains the run again."""
import json

import pytest

from deepspeed_image_trainer.cli import launch as launch_deepspeed
from deepspeed_image_trainer.cli.options import parse_args
from deepspeed_image_trainer.cli.train import get_args_parser as training_parser
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import assert_usage_error_in_process
from test_adversarial import printed_config


def parsed(*argv):
    return parse_args(launch_deepspeed.get_args_parser, list(argv))


def test_a_recipe_sets_flags_under_the_command_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("epochs: 7\nbatch-size: 8\nlearning_rate: 1e-2\nnesterov: true\noptimizer: sgd\n"
                      "bf16: false\nlayer_decay: null\n")
    args = parsed("--config", str(recipe), "--epochs", "3")
    assert (args.epochs, args.batch_size, args.learning_rate, args.nesterov) == (3, 8, 0.01, True)
    assert args.config == str(recipe) and args.layer_decay is None  # null: the flag's default
    # the recipe's flags count as given (they override a --deepspeed_config's values, as flags do)
    assert {"epochs", "batch_size", "learning_rate", "nesterov", "optimizer", "bf16"} <= args.explicit
    assert "layer_decay" not in args.explicit and "config" not in args.explicit
    (tmp_path / "r.json").write_text(json.dumps({"epochs": 2, "mixup_alpha": 0.2}))
    args = parsed("--config", str(tmp_path / "r.json"))
    assert (args.epochs, args.mixup_alpha) == (2, 0.2)


@pytest.mark.parametrize("text, suffix, message", [
    ("learnin_rate: 0.1\n", ".yaml", "'learnin_rate' is not a flag a recipe can set (did you mean learning_rate?)"),
    ("config: other.yaml\n", ".yaml", "'config' is not a flag a recipe can set"),
    ("epochs: [1, 2]\n", ".yaml", "epochs takes one value, got [1, 2]"),
    ("bf16: 1\n", ".yaml", "bf16 takes true or false, got 1"),
    ("epochs: {a: 1}\n", ".yaml", "epochs takes one value"),
    ("- epochs\n", ".yaml", "expected a mapping of flags to values (learning_rate: 0.001), got list"),
    ("epochs: [\n", ".yaml", "not valid YAML"),
    ("{\"epochs\": ", ".json", "not valid JSON"),
    ("epochs: 2\n", ".txt", "expected a .yaml, .yml or .json file"),
    ("!!python/object/apply:os.system [\"touch ran\"]\n", ".yaml", "not valid YAML"),  # safe_load: no objects
])
def test_a_recipe_that_cannot_be_read_is_refused_in_one_line(tmp_path, monkeypatch, capsys, text, suffix, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"r{suffix}").write_text(text)
    assert_usage_error_in_process(launch_deepspeed.main, ["--config", f"r{suffix}", "--dry_run"], capsys, message)
    assert not (tmp_path / "ran").exists()


def test_a_recipe_value_of_the_wrong_kind_is_refused_by_argparse(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text("optimizer: adam\n")
    assert_usage_error_in_process(launch_deepspeed.main, ["--config", "r.yaml"], capsys,
                                  "argument --optimizer: invalid choice: 'adam'")
    assert_usage_error_in_process(launch_deepspeed.main, ["--config", "missing.yaml"], capsys,
                                  "--config missing.yaml: cannot read it")
    with pytest.raises(UsageError, match=r"give --config in full \(read r.yaml as --config\)"):
        parsed("--conf", "r.yaml")


@pytest.mark.slow
def test_the_written_flags_train_the_run_again(trained, tiny_data, tmp_path, monkeypatch, capsys):
    """args.yaml as the recipe of a new run: the same flags, and the DeepSpeed config the run resolved."""
    workdir, _ = trained("zero1-bf16-offload-accumulation")
    history = json.loads((workdir / "logs/training_history.json").read_text())
    flags = history["config"]["args"]
    assert {"zero_stage", "bf16", "offload_optimizer", "gradient_accumulation_steps"} <= set(flags["given"])
    again = parse_args(training_parser, ["--config", str(workdir / "logs/args.yaml")])
    assert {name: value for name, value in vars(again).items() if name in flags["given"]} == flags["given"]
    assert again.explicit == set(flags["given"])
    assert {name: value for name, value in vars(again).items() if name in flags["defaults"]} == flags["defaults"]
    monkeypatch.chdir(workdir)
    capsys.readouterr()
    assert launch_deepspeed.main(["--config", "logs/args.yaml", "--dry_run", "--overwrite"]) == 0
    assert printed_config(capsys.readouterr().out) == history["config"]["deepspeed"]
