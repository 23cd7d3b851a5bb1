"""``causalkv vllm-omni-checkpoint DIR``: a tiny LingBot-World folder in vLLM-Omni's own format.

The sibling of ``causalkv sglang-checkpoint``: builds (or finds complete) the folder with
`causalkv.vllm_omni.checkpoint.write_checkpoint` (atomically, like the presets). Needs no vLLM or
vLLM-Omni. A folder that holds anything else is refused with what it holds; every fault is one
line (exit 2 for the folder, 1 for a write that failed, 130/143 for a signal), the folder left
as it was.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from causalkv.cli.faults import Stdout, Steps, run_guarded
from causalkv.errors import ConfigError

__all__ = ["build", "register"]

#: what the printed note says about the folder and vLLM-Omni's pipeline
NOTE = ("note: vLLM-Omni's LingBotWorldCausalDMDPipeline loads this folder's tokenizer, text "
        "encoder and VAE, then refuses the tiny DiT (CausalLingBotWorldTransformer3DModel."
        "from_config takes LingBot-World v2's 40 layers x 40 heads x 128 only); the DiT class "
        "built at this geometry loads transformer/ through vLLM-Omni's DiffusersPipelineLoader "
        "(docs/vllm_omni.md)")


def build(folder: str | Path) -> tuple[Path, bool]:
    """Build the checkpoint into ``folder``; ``(folder, found_complete)``.

    Raises:
        ConfigError: ``folder`` is a file, or exists, is not empty and holds no complete
            checkpoint (never overwritten), or is somewhere no folder can be created.
        OutputWriteError: the write failed (a full disk): the folder is as it was.
    """
    # lazy: the runtime's build helpers (and torch, by the writer) load when a folder is built
    from causalkv.runtime.files.file_checks import check_creatable_folder, fs_error_reason
    from causalkv.runtime.files.outputs import OutputWriteError
    from causalkv.runtime.model_io.presets import build_atomically
    from causalkv.vllm_omni.checkpoint import is_complete_checkpoint, write_checkpoint

    folder = Path(folder).expanduser().absolute()
    where = f"vllm-omni-checkpoint DIR {str(folder)!r}"
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{where} is a file, not a folder; choose a new or empty folder")
    if is_complete_checkpoint(folder):
        return folder, True
    if folder.exists():
        entries = sum(1 for _ in folder.iterdir())
        if entries:
            raise ConfigError(
                f"{where} exists, holds {entries} entr{'y' if entries == 1 else 'ies'} and is not "
                "a complete causalkv vLLM-Omni checkpoint; choose a new or empty folder (it is "
                "never overwritten)"
            )
        folder.rmdir()
    check_creatable_folder(folder.parent, where, "choose a folder where files can be created")
    try:
        build_atomically(folder, write_checkpoint, is_complete_checkpoint)
    except OSError as exc:
        raise OutputWriteError(
            f"could not write the checkpoint into {str(folder)!r} "
            f"({fs_error_reason(exc, folder.parent)}); nothing was changed there; free some "
            "space or choose another folder"
        ) from None
    return folder, False


def _main(args: argparse.Namespace) -> int:
    def body() -> int:
        folder, cached = build(args.dir)
        out = Stdout()  # a reader that goes away (`| head`) ends the printing: the folder is built
        out(f"{'found complete' if cached else 'built'} tiny LingBot-World checkpoint in "
            f"{folder} (vLLM-Omni 0.30.0 layout: LingBotWorldCausalDMDPipeline, "
            "CausalLingBotWorldTransformer3DModel; RANDOM weights)")
        out(NOTE)
        out.flush()
        return 0

    return run_guarded("causalkv vllm-omni-checkpoint", body, debug=bool(args.debug),
                       progress=Steps(f"{args.dir!r} is left as it was"))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``vllm-omni-checkpoint`` subcommand."""
    parser = subparsers.add_parser(
        "vllm-omni-checkpoint",
        help="build a tiny LingBot-World checkpoint in vLLM-Omni's own folder format",
        description="Build a tiny LingBot-World checkpoint (seeded random weights, nothing "
        "downloaded) in the folder layout, config keys and safetensors names vLLM-Omni 0.30.0's "
        "LingBot-World loader reads. A complete folder is kept as it is; any other non-empty "
        "DIR is refused.",
    )
    parser.add_argument("dir", help="folder to build (created; reused when already complete)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    parser.set_defaults(func=_main)
