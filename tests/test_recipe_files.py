"""--config FILE: a recipe of flag values (YAML or JSON) under the command line's, and the args.yaml every run
writes beside its history, which trains the run again."""
import json

import pytest

from deepspeed_image_trainer.cli import launch as launch_deepspeed
from deepspeed_image_trainer.cli.options import parse_args
from deepspeed_image_trainer.cli.train import get_args_parser as training_parser
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import ROOT, assert_usage_error_in_process


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
    ("epochs: [1, 2]\n", ".yaml", "epochs takes one value, got a list of 2 item(s)"),
    # aliases of aliases: a list of 9**5 items in 150 bytes, whose repr was the message (157 MB at 9**8)
    ("seed: [&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], "
     "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]]\n", ".yaml",
     "seed takes one value, got a list of 5 item(s)"),
    ("bf16: 1\n", ".yaml", "bf16 takes true or false, got 1"),
    ("epochs: {a: 1}\n", ".yaml", "epochs takes one value, got a mapping of 1 item(s)"),
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
    from test_adversarial import printed_config  # here: this module is imported again by spawned processes, where
    # test_adversarial's memory_profile may be src/'s forwarder of that name
    workdir, _ = trained("zero2-2ranks")
    history = json.loads((workdir / "logs/training_history.json").read_text())
    flags = history["config"]["args"]
    # the launcher's too: on one rank it would be another global batch, another run
    assert {"zero_stage", "sync_bn", "batch_size"} <= set(flags["given"]) and flags["given"]["num_gpus"] == 2
    again = parse_args(training_parser, ["--config", str(workdir / "logs/args.yaml")])  # its world: its launcher's
    training = {name: value for name, value in flags["given"].items() if name not in ("num_gpus", "num_nodes")}
    assert {name: value for name, value in vars(again).items() if name in training} == training
    assert again.explicit == set(training)
    assert {name: value for name, value in vars(again).items() if name in flags["defaults"]} == flags["defaults"]
    monkeypatch.chdir(workdir)
    capsys.readouterr()
    assert launch_deepspeed.main(["--config", "logs/args.yaml", "--dry_run", "--overwrite"]) == 0
    assert printed_config(capsys.readouterr().out) == history["config"]["deepspeed"]


RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
# What each short run changes: the data, one epoch, small images and batches (the recipe's sizes are a GPU's)
SHORT = ["--epochs", "1", "--batch_size", "4", "--image_size", "32", "--num_workers", "0", "--save_every", "0",
         "--save_last_every", "0", "--warmup_epochs", "0.5"]


def recipe_runs(process, _, results, data, workdir, torch_home):
    """Each shipped recipe, as written but for SHORT, by the trainer's main() in this process; ViT-B/16 slim (its
    class at a fraction of its size, as the family runs build it), torchvision's weights from files of its names."""
    import gc
    import os

    from deepspeed_image_trainer.cli import train
    from deepspeed_image_trainer.engine.distributed import free_port

    from conftest import join_process_group
    from test_models import imagenet_weights_file, slim_transformers

    os.environ["TORCH_HOME"] = str(torch_home)
    slim_transformers()
    imagenet_weights_file(torch_home, "efficientnet_b0")
    imagenet_weights_file(torch_home, "vit_b_16", image_size=224)  # the weights' size; the run's is 32
    join_process_group(0, free_port())
    train.shut_down = lambda: None  # the group serves every run
    for recipe in RECIPES:
        import yaml

        folder, written = workdir / recipe.stem, yaml.safe_load(recipe.read_text())
        sizes = ["--val_resize_size", "40", "--val_crop_size", "36"] if "val_crop_size" in written else []
        # the learning rate scaled with the batch, as the recipes say (SGD at 0.5 on 4 images diverged)
        rate = ["--learning_rate", str(written["learning_rate"] * 4 / written["batch_size"])]
        results[recipe.stem] = train.main(["--config", str(recipe), "--train_dir", str(data / "train"), "--val_dir",
                                           str(data / "val"), *SHORT, *sizes, *rate, "--checkpoint_dir",
                                           str(folder / "ck"), "--log_dir", str(folder / "logs")])
        gc.unfreeze()
        gc.collect()


@pytest.mark.slow
def test_the_shipped_recipes_run_as_written(tmp_path):
    import yaml

    from conftest import history_of, make_sample_dataset, spawn_ranks

    assert len(RECIPES) == 3
    # 6 training images: one step a run (ResNet50's --ra_reps 4 makes it 6)
    make_sample_dataset(tmp_path / "data", num_classes=3, train_per_class=2, val_per_class=1, image_size=32, seed=0)
    statuses = spawn_ranks(recipe_runs, 1, tmp_path / "data", tmp_path, tmp_path / "torch")
    assert statuses == {recipe.stem: 0 for recipe in RECIPES}
    for recipe in RECIPES:
        written = yaml.safe_load(recipe.read_text())
        given = history_of(tmp_path / recipe.stem)["config"]["args"]["given"]
        short = {key: value for key, value in given.items()
                 if f"--{key}" in SHORT or key.startswith("val_") or key == "learning_rate"}
        assert {key: value for key, value in given.items() if key not in short and "_dir" not in key} == {
            key: value for key, value in written.items() if key not in short}, recipe.name
