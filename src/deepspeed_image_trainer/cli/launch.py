"""The launcher: flags to a DeepSpeed config, checked, then src/train_deepspeed.py under the `deepspeed` launcher
(launch_deepspeed.py at the root of the project runs main)."""
import base64
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import tempfile
from pathlib import Path

from ..data.check import check_data, decodes_every_file
from ..engine.config import load_base_config, num_parameters
from ..engine.finetune import grouping, parameter_groups
from ..engine.distributed import check_address, check_port_free, check_timeout, free_port
from ..engine.interrupt import FINISHED_ENV, die_with_parent_call, finished, stopped_before_training
from ..engine.timing import LAUNCHED_AT_ENV, SPAWNED_AT_ENV
from ..models.names import DEFAULT_MODEL
from ..outputs import run_folders
from ..utils.failures import CliParser, UsageError, check_writable, path_argument, stop_on_write_error
from ..utils.files import write_json_atomic
from .options import add_training_args, norm_batch_size, parse_args
from .preflight import preflight, take_saved_weights_name, weights_to_load

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "train_deepspeed.py"  # src/
LAUNCHER_FLAGS = {"num_gpus", "num_nodes", "hostfile", "master_addr", "master_port", "launcher", "node_rank",
                  "dry_run"}
# What a --dry_run without the dataset assumes: Animals-90, the default job.
ANIMALS90_CLASSES, ANIMALS90_TRAIN_IMAGES = 90, 5400
# After DeepSpeed's launcher exits, the time left to the training processes (saving at a stop) before SIGKILL:
# DeepSpeed's launcher itself gives each rank 30 s after a SIGTERM.
STOP_GRACE_S = 120
# DeepSpeed's multi-node backends; "none": start this script on each node by hand with --node_rank.
LAUNCHERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm", "none")


def get_args_parser():
    parser = CliParser(description="Build a DeepSpeed config from flags and launch training.")
    launch = parser.add_argument_group("Launcher")
    launch.add_argument("--num_gpus", type=int, default=None,
                        help="GPUs per node (default: all visible GPUs; 1 without GPUs)")
    launch.add_argument("--num_nodes", type=int, default=None,
                        help="nodes to use (default: every host in --hostfile, 1 without one)")
    launch.add_argument("--hostfile", type=path_argument, default=None,
                        help="DeepSpeed hostfile for multi-node runs: one `hostname slots=GPUS` line per node")
    launch.add_argument("--master_addr", default=None,
                        help="address of the first node (default: DeepSpeed asks it over ssh; needed with --launcher none)")
    launch.add_argument("--master_port", type=int, default=None,
                        help="rendezvous port (default: a free one on a single node, DeepSpeed's 29500 otherwise)")
    launch.add_argument("--launcher", choices=LAUNCHERS, default="pdsh",
                        help="how DeepSpeed starts the other nodes (pdsh over ssh by default); none: run this "
                             "command on every node yourself, each with its --node_rank")
    launch.add_argument("--node_rank", type=int, default=None,
                        help="this node's index in the hostfile (0 .. nodes-1), with --launcher none")
    launch.add_argument("--dry_run", action="store_true",
                        help="print the resolved DeepSpeed config and the command, then exit")
    launch.add_argument("--list_models", nargs="*", default=None, metavar="WHAT",
                        help="list the models --model takes, then exit: torchvision's (parameters, input size, "
                             "weights), or with `timm [FILTER]` timm's (FILTER a wildcard: 'vit_*', '*dinov3*')")
    return add_training_args(parser)


def checked_listing(words):
    """(source, pattern) of --list_models' words: nothing or torchvision, or timm and a wildcard."""
    if words[:1] in ([], ["torchvision"]) and len(words) <= 1:
        return None, None
    if words[:1] == ["timm"] and len(words) <= 2:
        return "timm", (words[1:] or [None])[0]
    raise UsageError(f"--list_models {' '.join(words)}: give nothing (torchvision's models), or timm and at most one "
                     "wildcard (--list_models timm 'vit_*')")


def given_config_path(log_dir, base):
    """Where the user's --deepspeed_config goes, as read here, for the ranks: named for its content, so that the
    launcher of a later node or another run never changes the file a rank is about to read."""
    digest = hashlib.sha256(json.dumps(base, sort_keys=True).encode()).hexdigest()[:12]
    return Path(log_dir) / f"ds_config_given-{digest}.json"


def check_visible_gpus(num_gpus, multi_node):
    """Refuse more GPUs than this machine shows. Without GPUs --num_gpus N starts N CPU ranks; on several
    nodes the hostfile's slots describe the other machines, so there is nothing to compare here."""
    import torch

    visible = torch.cuda.device_count()
    if visible and not multi_node and num_gpus is not None and num_gpus > visible:
        raise UsageError(f"--num_gpus {num_gpus}, but this machine has {visible} visible GPU(s): use --num_gpus "
                         f"{visible} or fewer (CUDA_VISIBLE_DEVICES decides which GPUs are visible)")


def default_num_gpus():
    import torch

    return torch.cuda.device_count() or 1


def launcher_flags(args, num_gpus, num_nodes):
    """The launcher's flags a run's args.yaml records, so that it trains the run again: how many GPUs and nodes it
    ran on, and where (not the port, which another run may hold next time)."""
    given = {name: getattr(args, name) for name in ("hostfile", "launcher", "master_addr")
             if name in args.explicit and args.hostfile}  # one node ignores --master_addr (it says so)
    return {**{name: value for name, value in (("num_gpus", num_gpus), ("num_nodes", num_nodes)) if value is not None},
            **given}


def forwarded_args(args, given_path=None, launch_token=None, launcher=None):
    """The training script's arguments: every training flag the user gave, and the user's JSON as read here
    (written to `given_path`), from which the script builds the config again. Not the config resolved here:
    there every number, the LR schedule's step counts from the data check's count of images included, would
    read as the user's own; nor the user's file, which may have changed since. `launch_token` tells rank 0
    that this launcher holds the folders for it (run_folders)."""
    argv = ["--deepspeed_config", str(given_path)] if given_path else []
    argv += ["--launch_token", launch_token] if launch_token else []
    argv += ["--launcher_flags", json.dumps(launcher)] if launcher else []
    for name in sorted(args.explicit - LAUNCHER_FLAGS - {"deepspeed_config"}):
        value = getattr(args, name)
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        else:
            argv += [f"--{name}", str(value)]
    return argv


def read_hostfile(path):
    """[(host, slots)] from a DeepSpeed hostfile (`worker-1 slots=8` lines, `#` comments), as its runner reads it."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise UsageError(f"--hostfile {path}: {err.strerror or err}") from None
    hosts = []
    for line in (line.strip() for line in lines):
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if not match or match[1] in dict(hosts):
            raise UsageError(f"--hostfile {path}: bad line {line!r}; each line is `hostname slots=N`, hosts unique")
        hosts.append((match[1], int(match[2])))
    if not hosts:
        raise UsageError(f"--hostfile {path} lists no hosts; each line is `hostname slots=N`")
    return hosts


def resolve_topology(args):
    """(GPUs per node, nodes, world size) from the launcher flags, checked the way DeepSpeed would use them."""
    hosts = read_hostfile(args.hostfile) if args.hostfile else None
    num_nodes = args.num_nodes if args.num_nodes is not None else len(hosts or [None])
    num_gpus = args.num_gpus if args.num_gpus is not None else (None if hosts else default_num_gpus())
    if (num_gpus is not None and num_gpus < 1) or num_nodes < 1:
        raise UsageError("--num_gpus and --num_nodes must be at least 1")
    if hosts is None and num_nodes > 1:
        raise UsageError(f"--num_nodes {num_nodes} needs a --hostfile listing the nodes")
    if hosts is not None and num_nodes > len(hosts):
        raise UsageError(f"--num_nodes {num_nodes} but --hostfile {args.hostfile} lists {len(hosts)} host(s)")
    if args.launcher == "none":
        if hosts is None or args.master_addr is None or args.node_rank is None:
            raise UsageError("--launcher none starts one node: give --hostfile, --master_addr and this node's "
                             "--node_rank, and run the same command on every node")
        if not 0 <= args.node_rank < num_nodes:
            raise UsageError(f"--node_rank {args.node_rank} is outside 0..{num_nodes - 1}")
    elif args.node_rank is not None:
        raise UsageError("--node_rank is for starting each node by hand: add --launcher none")
    elif hosts is None and "launcher" in args.explicit:
        raise UsageError(f"--launcher {args.launcher} starts several nodes: give the --hostfile that lists them")
    slots = [slots for _, slots in hosts[:num_nodes]] if hosts else [num_gpus]
    world_size = sum(min(s, num_gpus or s) for s in slots)
    return num_gpus, num_nodes, world_size


def local_devices(num_gpus):
    """The device ids of a one-node run: the first `num_gpus` of CUDA_VISIBLE_DEVICES when it is set (the
    `deepspeed` runner drops it as soon as --num_gpus is given), else 0 .. num_gpus-1."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[:num_gpus] if visible else list(range(num_gpus))


def build_command(args, num_gpus, num_nodes, given_path=None, launch_token=None):
    """The DeepSpeed launcher command (or, on Windows, the training script itself).

    On one node this is DeepSpeed's per-node launcher, `deepspeed.launcher.launch`, with the world
    description the `deepspeed` runner would pass it: the runner adds nothing else there but a process
    that imports DeepSpeed (seconds before the first step). Several nodes go through the runner.
    """
    launcher = launcher_flags(args, num_gpus, num_nodes)
    script = [str(TRAIN_SCRIPT), *forwarded_args(args, given_path, launch_token, launcher)]
    if os.name == "nt":
        # The deepspeed launcher needs pdsh/NCCL-style multi-process support that Windows lacks.
        return [sys.executable, *script]
    if not args.hostfile:
        world_info = base64.urlsafe_b64encode(json.dumps({"localhost": local_devices(num_gpus)}).encode()).decode()
        return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                "--master_addr=127.0.0.1", f"--master_port={args.master_port or free_port()}", *script]
    command = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if num_gpus is not None:
        command += ["--num_gpus", str(num_gpus)]
    command += ["--hostfile", args.hostfile, "--num_nodes", str(num_nodes)]
    if args.launcher == "none":
        command += ["--no_ssh", "--node_rank", str(args.node_rank)]
    elif args.launcher != "pdsh":
        command += ["--launcher", args.launcher]
    if args.master_addr:
        command += ["--master_addr", args.master_addr]
    if args.master_port:
        command += ["--master_port", str(args.master_port)]
    return command + script


def main(argv=None, launched_at=None):
    """`launched_at`: when the command started (time.time()), from which the ranks count their startup."""
    args = parse_args(get_args_parser, argv)
    if not TRAIN_SCRIPT.is_file():  # the package installed without the project's scripts
        raise UsageError(f"the training script {TRAIN_SCRIPT} is missing: run the launcher from the project (or "
                         "install it with pip install -e .)")
    if args.list_models is not None:
        from ..models.build import list_models

        print(list_models(*checked_listing(args.list_models)))
        return 0
    num_gpus, num_nodes, world_size = resolve_topology(args)
    if os.name == "nt" and world_size > 1:
        raise UsageError("on Windows DeepSpeed runs on a single GPU only (no NCCL): use --num_gpus 1")
    check_timeout()  # the ranks' DeepSpeed reads it as it is imported, once this has written the run's config
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise UsageError(f"--master_port {args.master_port} is not a port number: use 1024-65535")
    if args.master_port is not None and not args.hostfile and not args.dry_run:
        check_port_free(args.master_port, "--master_port")
    if args.master_addr is not None and args.hostfile:
        check_address(args.master_addr, "--master_addr")
    elif args.master_addr is not None:
        print(f"note: --master_addr {args.master_addr} is for runs over several nodes (--hostfile): the ranks of one "
              "node meet at 127.0.0.1", file=sys.stderr)
    check_visible_gpus(num_gpus, multi_node=bool(args.hostfile))
    check_writable(args.checkpoint_dir, "--checkpoint_dir")
    check_writable(args.log_dir, "--log_dir")
    if args.node_rank in (None, 0):  # later nodes start once the first one holds the folders (below)
        run_folders.check_free(args)  # before the checks below read a checkpoint the run in them is writing
    import torch

    from ..data.cache import OFF, check_usable

    check_usable(args)

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    # Pre-flight: an unusable dataset stops here, before any process starts; the training script reads
    # the per-file results back from the cache instead of decoding every image again.
    if args.dry_run and not Path(args.train_dir).exists():
        data_check = None
        class_names = [f"class_{i}" for i in range(ANIMALS90_CLASSES)]
        num_train_images = ANIMALS90_TRAIN_IMAGES
        print(f"note: {args.train_dir} not found; the config below assumes Animals-90's {ANIMALS90_CLASSES} classes "
              f"and {ANIMALS90_TRAIN_IMAGES} training images", file=sys.stderr)
    else:
        data_check = check_data(args.train_dir, args.val_dir,
                                decodes_every_file(args.data_on_device, device_type, args.cache_dir == OFF))
        class_names, num_train_images = data_check.classes, data_check.train.num_images
    num_params = num_parameters(len(class_names))
    take_saved_weights_name(args)
    groups = 1
    # the training script's checks of the model, before any process starts (and its parameter groups counted)
    if (args.model != DEFAULT_MODEL or args.pretrained or args.batch_size == 1 or grouping(args)
            or args.val_crop_size not in (None, args.image_size)):
        from ..models.build import checked_model, not_downloaded
        from ..models.timm_models import checkpointing, is_timm

        # downloads torchvision's weights once, here, rather than in every rank; a dry run writes nothing
        weights = weights_to_load(args)
        if args.dry_run and (download := not_downloaded(args.model, weights)):
            print(f"note: --pretrained {weights}: the run downloads {download.name} into {download.parent} (a dry run "
                  "does not; its shapes are checked without the weights)", file=sys.stderr)
            weights = None
        shapes = checked_model(args.model, len(class_names), args.image_size,
                               norm_batch_size(args.batch_size, args.sync_bn, world_size), weights, args.val_crop_size,
                               args.batch_size)
        if args.grad_checkpointing and is_timm(args.model):  # a timm model without it stops here, not in every rank
            checkpointing(shapes, args.model)
        num_params = sum(p.numel() for p in shapes.parameters())
        groups = len(parameter_groups(shapes, len(class_names), args)) if grouping(args) else 1
    base = load_base_config(args.deepspeed_config)
    checked = preflight(args, base, world_size=world_size, device_type=device_type, class_names=class_names,
                        num_train_images=num_train_images, num_params=num_params, read_shards=True,
                        parameter_groups=groups)
    config, resume_from = checked.ds_config, checked.resume_from
    if checked.finished:
        print(checked.finished)
        return 0
    given_path = given_config_path(args.log_dir, base) if args.deepspeed_config else None
    if args.dry_run:
        run_folders.check_new_run(args, resume_from)  # what the run would refuse first
        for line in data_check.warnings() if data_check else ():  # else the training's rank 0 says them
            print(line, file=sys.stderr)
        print(json.dumps(config, indent=2))
        # the user's own JSON, which the command then reads: a dry run writes no copy of it into --log_dir
        print(shlex.join(build_command(args, num_gpus, num_nodes, args.deepspeed_config)))
        return 0
    # The folders are this run's from here until this process exits, before it writes into them: a second run
    # stops without touching the first one's files. Later nodes start once the first one holds them.
    launch_token = run_folders.claim(args, resume_from) if args.node_rank in (None, 0) else None
    try:
        config_path = run_folders.config_path(args)
        command = build_command(args, num_gpus, num_nodes, given_path, launch_token)
        data_check.save_cache()
        written = [config_path] + ([given_path] if given_path and not given_path.exists() else [])
        with stop_on_write_error("DeepSpeed config", "--log_dir"):
            write_json_atomic(config_path, config)  # each node's launcher may write it into one shared folder
            if given_path:
                write_json_atomic(given_path, base)
        print(f"DeepSpeed config written to {config_path}\n$ {shlex.join(command)}", flush=True)
        status = run_and_forward_signals(command, launched_at or time.time())
        if config_path.name == run_folders.NEXT_DS_CONFIG:  # the run ended before it replaced the earlier one
            for path in written:
                path.unlink(missing_ok=True)
        return status
    finally:
        run_folders.release()


SAME_REQUEST_S = 0.5
# DeepSpeed's per-node launcher with its output wrapped as the trainer's is: its log lines would otherwise end in
# "--- Logging error ---" tracebacks once the reader of the output has gone (`launch_deepspeed.py ... | head`)
OUTLIVING_LAUNCHER = (
    "import runpy, sys; sys.path.insert(0, {src!r}); "
    "from deepspeed_image_trainer.utils.streams import outlive_closed_output; outlive_closed_output(); "
    "runpy.run_module('deepspeed.launcher.launch', run_name='__main__', alter_sys=True)")


def outliving_closed_output(command):
    """`command` as run: DeepSpeed's per-node launcher started through OUTLIVING_LAUNCHER."""
    if command[1:4] != ["-u", "-m", "deepspeed.launcher.launch"]:
        return command
    src = str(Path(__file__).resolve().parents[2])
    return [command[0], "-u", "-c", OUTLIVING_LAUNCHER.format(src=src), *command[4:]]


def run_and_forward_signals(command, launched_at):
    """Run `command` in its own process group and return its status, or 128 + the signal's number when
    stopped by one (DeepSpeed's launcher itself exits 1 then).

    SIGINT/SIGTERM reach every process of the group as SIGTERM: the ranks finish their step, save a
    resumable checkpoint and exit; a second one kills them. This waits for all of them (DeepSpeed's
    launcher alone would exit first), at most STOP_GRACE_S after DeepSpeed's launcher has exited; and the
    group goes with this process, however it dies. A signal that comes once rank 0 has said the run finished
    (FINISHED_ENV) stops nothing: 0.
    """
    try:
        fd, marker = tempfile.mkstemp(prefix="trainer-finished-")
        os.close(fd)
    except OSError:  # no temporary folder: such a signal is reported as a stop
        return _run_and_forward_signals(command, launched_at, None)
    try:
        return _run_and_forward_signals(command, launched_at, marker)
    finally:
        os.unlink(marker)


def _run_and_forward_signals(command, launched_at, marker):
    env = {**os.environ, LAUNCHED_AT_ENV: repr(launched_at), SPAWNED_AT_ENV: repr(time.time()),
           **({FINISHED_ENV: marker} if marker else {})}
    received, spawned, last, children = [], threading.Event(), [0.0], []

    def forward(signum, frame):
        # `timeout` sends its signal to this process and again to its own process group, this one included:
        # the same signal within a moment of the first is that one request, not a second asking to kill
        now = time.monotonic()
        if received and signum == received[-1] and now - last[0] < SAME_REQUEST_S:
            return
        last[0] = now
        received.append(signum)
        if not children:  # before the child exists: sent to it once it does
            return
        if len(received) == 1:
            if has_children(children[0].pid):
                spawned.set()
            if spawned.is_set() and not finished(marker):
                print("Stopping: once training has started, it saves a checkpoint at its current step (again to "
                      "kill it now)", file=sys.stderr, flush=True)
        signal_group(children[0].pid, signal.SIGTERM if len(received) == 1 else signal.SIGKILL)

    # The handlers before the child: a Ctrl-C between the two ended this process in a KeyboardInterrupt traceback
    # and left the child, a session of its own, running.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    child = subprocess.Popen(outliving_closed_output(command), start_new_session=True, env=env,
                             preexec_fn=die_with_parent_call(os.getpid()))
    children.append(child)
    if received:
        signal_group(child.pid, signal.SIGTERM if len(received) == 1 else signal.SIGKILL)

    def watch():  # DeepSpeed's launcher imports for seconds before it spawns the training processes
        while child.poll() is None and not spawned.is_set():
            if has_children(child.pid):
                spawned.set()
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    status = wait_for_launcher(child, marker if command[1:4] == ["-u", "-m", "deepspeed.launcher.launch"] else None)
    status = 128 - status if status < 0 else status  # killed by a signal: the shell's convention
    # The error lines below start with a newline: a killed rank's progress bar leaves its line unfinished.
    deadline = time.monotonic() + STOP_GRACE_S
    while group_is_running(child.pid):  # the group outlives DeepSpeed's launcher while ranks save
        if time.monotonic() > deadline:
            signal_group(child.pid, signal.SIGKILL)
            print(f"\nerror: training processes still running {STOP_GRACE_S} s after DeepSpeed's launcher exited "
                  "were killed", file=sys.stderr, flush=True)
            return 128 + signal.SIGKILL
        time.sleep(0.2)
    if received and finished(marker):  # the signal came in the teardown (DeepSpeed's launcher then exits 1)
        print(f"The run had finished when {signal.Signals(received[0]).name} came", file=sys.stderr, flush=True)
        return 0
    if len(received) > 1:
        print("\nerror: the training processes were killed (a second Ctrl-C or SIGTERM); --resume auto continues "
              "from the last checkpoint published, if any", file=sys.stderr, flush=True)
        return 128 + signal.SIGKILL
    if received:
        if not spawned.is_set():
            print(stopped_before_training(received[0]), file=sys.stderr, flush=True)
        return 128 + received[0]
    # DeepSpeed's launcher exits with a rank's return code, -9 for a SIGKILL; or it was killed itself
    if status in (256 - signal.SIGKILL, 128 + signal.SIGKILL):
        print("\nerror: a training process was killed by SIGKILL from outside the trainer (the kernel's out-of-memory "
              "killer sends it when the host's memory runs out); --resume auto continues from the last checkpoint "
              "published, if any", file=sys.stderr, flush=True)
        return 128 + signal.SIGKILL
    if 256 - signal.SIGRTMIN < status < 256:  # DeepSpeed's launcher passes on a rank's -N: it died of signal N
        died = 256 - status
        why = (" (a memory-mapped file cut short under it: the decoded-image cache truncated while the run read it?)"
               if died == signal.SIGBUS else "")
        try:
            name = signal.Signals(died).name
        except ValueError:  # a number without a name here
            name = f"signal {died}"
        print(f"\nerror: a training process died of {name}{why}; --resume auto continues from the last checkpoint "
              "published, if any", file=sys.stderr, flush=True)
        return 128 + died
    return status


def wait_for_launcher(child, marker):
    """The exit status of DeepSpeed's launcher `child`. Its per-node launcher looks at its ranks once a second and
    sleeps a second more once the last has gone, about 2 s of every run's end: given `marker` (that launcher's
    FINISHED_ENV file), once rank 0 has said the run finished and every rank has exited it is ended here, and
    the run's status is 0. Its ranks are its own children, which it alone reaps."""
    while True:
        try:
            return child.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        if marker is not None and finished(marker) and not has_children(child.pid, living=True):
            child.kill()
            child.wait()
            return 0


def has_children(pid, living=False):
    """Whether process `pid` has started any process (`living`: one that has not exited; psutil: DeepSpeed's own
    dependency)."""
    import psutil

    try:
        children = psutil.Process(pid).children()
        return any(not living or child.status() != psutil.STATUS_ZOMBIE for child in children)
    except psutil.Error:  # gone already
        return False


def group_is_running(pgid):
    """Whether a process of group `pgid` is left that has not exited: the ranks of a launcher ended early (see
    wait_for_launcher) wait as zombies until the system reaps them (a second or more in a container)."""
    import psutil

    if not signal_group(pgid, 0):
        return False
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                return True
        except (psutil.Error, OSError):  # gone meanwhile
            continue
    return False


def signal_group(pgid, signum):
    """Send `signum` to a process group; False when no process of it is left."""
    try:
        os.killpg(pgid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False
