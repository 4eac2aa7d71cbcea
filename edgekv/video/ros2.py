"""ROS 2 on the wire without a ROS install: a DDS participant (Cyclone DDS's Python binding, the ``ros2`` extra)
that speaks ROS 2's conventions, and the ``ros2:`` frame source built on it.

What makes a DDS endpoint a ROS 2 one (ROS 2 design article "Topic and Service name mapping to DDS";
rosidl_generator_dds_idl; rmw/qos_profiles.h):

- **Names.** The ROS topic ``/camera/image_raw`` is the DDS topic ``rt/camera/image_raw`` (``rt`` = ROS topic;
  the namespace is part of the name, no DDS partition). A relative name (``input_query``) lives under
  ``ros2.namespace``.
- **Types.** The message ``sensor_msgs/msg/Image`` is the DDS type ``sensor_msgs::msg::dds_::Image_``, a struct
  of the .msg fields in order (nested messages named the same way: ``std_msgs::msg::dds_::Header_``,
  ``builtin_interfaces::msg::dds_::Time_``), serialized as plain CDR (XCDR1, little-endian: encapsulation
  0x0001), which every ROS 2 RMW of Humble reads and writes. Writers here ask for XCDR1 explicitly.
- **QoS.** Images: ROS 2's sensor-data profile (best effort, keep last 5, volatile) by default, so the reader
  matches any camera driver (a best-effort reader accepts best-effort and reliable writers). Questions,
  answers, tokens and status: ROS 2's default profile (reliable, keep last 10, volatile).
- **Domain.** ``ROS_DOMAIN_ID`` (or ``ros2.domain_id``) is the DDS domain id, which picks the UDP ports
  (7400 + 250 x domain, RTPS 2.2 section 9.6.1.1), so a robot on domain 7 is invisible from domain 0.

Discovery goes where Cyclone DDS's configuration says: ``ros2.interface`` (one network interface),
``ros2.peers`` (unicast addresses to probe) and ``ros2.multicast``; with none of them set, ``$CYCLONEDDS_URI``
(the variable ROS users already set for rmw_cyclonedds_cpp) or Cyclone's defaults decide. Tests run on
loopback with ``peers: [127.0.0.1]`` and multicast off.

Why DDS and not Zenoh (one transport only). The robot teams this serves run Humble (JetPack 6 is Ubuntu 22.04),
whose nodes speak DDS/RTPS: the default RMW (rmw_fastrtps_cpp) and rmw_cyclonedds_cpp both interoperate on
the wire with a plain DDS participant, so edgekv joins the robot's graph with nothing changed on the robot.
rmw_zenoh (binaries for Humble since 2025: ros/rosdistro#44368) talks only to nodes that run rmw_zenoh
themselves and discover each other through a router (``ros2 run rmw_zenoh_cpp rmw_zenohd``; without it "peers
will not discover or receive data", ros2/rmw_zenoh#445), so choosing Zenoh would mean switching every node on
the robot first, or adding a zenoh-bridge-ros2dds. Zenoh's advantages are real: ``eclipse-zenoh`` ships
manylinux_2_28 aarch64 wheels, while PyPI's ``cyclonedds`` has none for Linux aarch64 (``pip download
--platform manylinux2014_aarch64 cyclonedds`` finds no version, 0.9.0 to 11.0.1; cyclonedds-python#304), so a
Jetson builds Cyclone DDS's C library first (jetson/ros2/README.md); and Zenoh copes better with Wi-Fi, where
DDS multicast discovery is unreliable (``ros2.peers`` and ``multicast: false`` are the DDS answer to that).

Messages are taken from the DDS reader as their serialized bytes and decoded with rosbags
(``edgekv.video.ros_images``): one decoder for the live topic and for bags, and a truncated or malformed
message is one counted skip instead of an exception inside the binding.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgekv.video.ros_images import (
    COMPRESSED,
    IMAGE,
    STRING,
    StampClock,
    decode_cdr,
    frame_from_message,
    stamp_ns,
)
from edgekv.video.sources import (
    CorruptFrame,
    EndOfStream,
    Frame,
    FrameSource,
    SourceLost,
    SourceSpec,
    SourceUnavailable,
    _parse_query,
    _positive_float,
)

__all__ = ["Ros2Graph", "Ros2Source", "dds_topic", "dds_type", "domain_id", "cyclone_config", "parse", "open_parsed", "binding",
           "resolve_name"]

log = logging.getLogger("edgekv.ros2")

INSTALL_HINT = ("the Cyclone DDS Python binding is not installed: pip install 'edgekv[ros2]' (on a Jetson, "
                "aarch64, build Cyclone DDS's C library first: see jetson/ros2/README.md)")
DEFAULT_DEPTH = 10  # ROS 2's default QoS profile: reliable, keep last 10, volatile
POLICY_NAMES = {2: "durability", 4: "deadline", 8: "liveliness", 11: "reliability", 24: "message type",
                25: "data representation"}  # dds_qos_policy_id_t values that can make a reader and a writer miss


def _message_type(text: str) -> str:
    """``?type=``: image -> sensor_msgs/msg/Image, compressed -> sensor_msgs/msg/CompressedImage."""
    kinds = {"image": IMAGE, "compressed": COMPRESSED}
    if text not in kinds:
        raise ValueError("expected image (sensor_msgs/msg/Image) or compressed (sensor_msgs/msg/CompressedImage)")
    return kinds[text]


_SPEC_PARAMS: dict[str, Callable[[str], Any]] = {
    "type": _message_type,
    "max_step": _positive_float,  # seconds: a larger step between stamps is a jump of the stamping clock
    "stale": _positive_float,     # seconds without a message before the source counts as lost
}


# ---------------------------------------------------------------------------------------------- names
def resolve_name(name: str, namespace: str = "/") -> str:
    """A ROS 2 topic name made absolute: ``/x`` stays, ``x`` goes under ``namespace``; ``ValueError`` naming
    what is wrong with it otherwise (design.ros2.org "Topic and Service names")."""
    from edgekv.config import ros_name_problem

    if name.startswith("~"):
        raise ValueError(f"ROS topic {name!r}: private names ('~') need a node name; give an absolute or relative one")
    full = name if name.startswith("/") else namespace.rstrip("/") + "/" + name
    problem = ros_name_problem(full) or ("the root '/' is not a topic" if full == "/" else None)
    if problem:
        raise ValueError(f"ROS topic {name!r}: not a valid topic name ({problem})")
    return full


def dds_topic(ros_name: str) -> str:
    """``/camera/image_raw`` -> ``rt/camera/image_raw``."""
    return "rt" + ros_name


def dds_type(msgtype: str) -> str:
    """``sensor_msgs/msg/Image`` -> ``sensor_msgs::msg::dds_::Image_``."""
    package, kind, name = msgtype.split("/")
    return f"{package}::{kind}::dds_::{name}_"


def ros_type(dds_name: str) -> str:
    """``sensor_msgs::msg::dds_::Image_`` -> ``sensor_msgs/msg/Image`` (other DDS names are returned as they are)."""
    parts = dds_name.split("::")
    if len(parts) == 4 and parts[2] == "dds_" and parts[3].endswith("_"):
        return f"{parts[0]}/{parts[1]}/{parts[3][:-1]}"
    return dds_name


# ---------------------------------------------------------------------------------------------- settings
def domain_id(settings: Any) -> int:
    """``ros2.domain_id``, else ``$ROS_DOMAIN_ID``, else 0."""
    if settings.domain_id is not None:
        return int(settings.domain_id)
    text = os.environ.get("ROS_DOMAIN_ID", "").strip()
    if not text:
        return 0
    if not text.isdigit() or not 0 <= int(text) <= 232:
        raise SourceUnavailable(f"ROS_DOMAIN_ID={text!r}: expected a domain id 0..232")
    return int(text)


def check_interface(interface: str) -> None:
    """``SourceUnavailable`` in one line when ``interface`` is neither a network interface nor an address of this
    machine (Cyclone DDS itself would only fail to create the domain, with no word about why)."""
    import psutil

    addresses = psutil.net_if_addrs()
    if interface in addresses:
        return
    if any(entry.address.split("%")[0] == interface for entries in addresses.values() for entry in entries):
        return
    raise SourceUnavailable(f"ros2.interface: no network interface or local address {interface!r} on this machine "
                            f"(interfaces: {', '.join(sorted(addresses))})")


def cyclone_config(settings: Any) -> str | None:
    """Cyclone DDS XML for the ``ros2:`` section's network keys, or None when none is set (then
    ``$CYCLONEDDS_URI`` or Cyclone's defaults apply). Elements as documented for Cyclone DDS 0.10 and 11:
    ``General/Interfaces/NetworkInterface``, ``General/AllowMulticast``, ``Discovery/Peers/Peer``; with
    unicast peers, ``Discovery/ParticipantIndex auto`` gives each participant its own port, and peers are
    probed for indices up to ``MaxAutoParticipantIndex``."""
    if settings.interface is None and not settings.peers and settings.multicast:
        return None
    general = []
    if settings.interface is not None:
        check_interface(settings.interface)
        attribute = "address" if any(c in settings.interface for c in ".:") else "name"
        general.append(f'<Interfaces><NetworkInterface {attribute}="{_xml(settings.interface)}"/></Interfaces>')
    if not settings.multicast:
        general.append("<AllowMulticast>false</AllowMulticast>")
    discovery = []
    if settings.peers:
        peers = "".join(f'<Peer address="{_xml(peer)}"/>' for peer in settings.peers)
        discovery.append(f"<ParticipantIndex>auto</ParticipantIndex><MaxAutoParticipantIndex>"
                         f"{settings.max_participants}</MaxAutoParticipantIndex><Peers>{peers}</Peers>")
    return (f'<CycloneDDS><Domain id="any"><General>{"".join(general)}</General>'
            f'<Discovery>{"".join(discovery)}</Discovery></Domain></CycloneDDS>')


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace(">", "&gt;")


def _settings(settings: Any | None) -> Any:
    if settings is not None:
        return settings
    from edgekv.config import Ros2Section

    return Ros2Section()


# ---------------------------------------------------------------------------------------------- DDS types
@functools.cache
def binding() -> Any:
    """The cyclonedds modules and the message structs (edgekv/video/ros2_idl.py), imported on first use;
    ``SourceUnavailable`` with the install command when the binding (or its C library) is missing."""
    try:
        import cyclonedds.builtin as builtin
        import cyclonedds.core as core
        import cyclonedds.domain as domain
        import cyclonedds.pub as pub
        import cyclonedds.qos as qos
        import cyclonedds.sub as sub
        import cyclonedds.topic as topic

        from edgekv.video import ros2_idl
    except ImportError as exc:
        raise SourceUnavailable(f"{INSTALL_HINT} ({exc})") from None
    except Exception as exc:  # the binding is there but its C library is not (an aarch64 build without CYCLONEDDS_HOME)
        raise SourceUnavailable(f"the Cyclone DDS binding failed to load ({type(exc).__name__}: {exc}); see "
                                "jetson/ros2/README.md") from None
    return _Binding(core, domain, topic, pub, sub, qos, builtin, ros2_idl.STRUCTS, ros2_idl.Serialized)


@dataclass(frozen=True)
class _Binding:
    core: Any
    domain: Any
    topic: Any
    pub: Any
    sub: Any
    qos: Any
    builtin: Any
    structs: dict[str, type]  # message type -> IDL struct (edgekv/video/ros2_idl.py)
    serialized: type          # what their readers hand back


def sensor_qos(reliability: str = "best_effort", depth: int = 5) -> Any:
    """ROS 2's sensor-data profile (rmw_qos_profile_sensor_data): best effort, keep last 5, volatile."""
    policy = binding().qos.Policy
    kind = policy.Reliability.BestEffort if reliability == "best_effort" else policy.Reliability.Reliable(0)
    return binding().qos.Qos(kind, policy.History.KeepLast(depth), policy.Durability.Volatile)


def default_qos(depth: int = DEFAULT_DEPTH, writer: bool = False) -> Any:
    """ROS 2's default profile (rmw_qos_profile_default): reliable, keep last 10, volatile; writers in XCDR1."""
    policy = binding().qos.Policy
    policies = [policy.Reliability.Reliable(max_blocking_time=0), policy.History.KeepLast(depth),
                policy.Durability.Volatile]
    if writer:
        policies.append(policy.DataRepresentation(use_cdrv0_representation=True))
    return binding().qos.Qos(*policies)


# ---------------------------------------------------------------------------------------------- the graph
class Subscription:
    """A DDS reader whose samples (serialized bytes) go to ``on_sample(raw)`` in Cyclone DDS's listener thread."""

    def __init__(self, graph: Ros2Graph, topic: str, msgtype: str, qos: Any, on_sample: Callable[[bytes], None]) -> None:
        b = binding()
        self.topic, self.msgtype = topic, msgtype
        self.incompatible: dict[str, int] = {}  # QoS policy -> how many writers it kept from matching
        self.matched = 0
        self._on_sample = on_sample
        self._serialized = b.serialized
        listener = b.core.Listener(on_data_available=self._available, on_requested_incompatible_qos=self._incompatible,
                                   on_subscription_matched=self._matched)
        self.reader = b.sub.DataReader(graph.participant, graph.topic(topic, msgtype), qos=qos,
                                       listener=listener)

    def _available(self, reader: Any) -> None:
        try:
            while True:
                samples = reader.take(N=32)
                if not samples:
                    return
                for sample in samples:
                    if isinstance(sample, self._serialized) and sample.sample_info.valid_data:
                        self._on_sample(sample.data)
        except Exception:  # never let an exception unwind into the C listener thread
            log.exception("ROS 2 topic %s: reading a sample failed", self.topic)

    def _incompatible(self, reader: Any, status: Any) -> None:
        name = POLICY_NAMES.get(int(status.last_policy_id), f"QoS policy {status.last_policy_id}")
        self.incompatible[name] = int(status.total_count)
        log.warning("ROS 2 topic %s: a writer does not match this %s reader (incompatible %s)", self.topic,
                    self.msgtype, name)

    def _matched(self, reader: Any, status: Any) -> None:
        self.matched = int(status.current_count)

    def close(self) -> None:
        _delete(self.reader)


class Publication:
    """A DDS writer of ``std_msgs/msg/String`` (or another message type) on a ROS topic."""

    def __init__(self, graph: Ros2Graph, topic: str, msgtype: str, qos: Any) -> None:
        self.topic, self.msgtype = topic, msgtype
        self._struct = binding().structs[msgtype]
        self.writer = binding().pub.DataWriter(graph.participant, graph.topic(topic, msgtype), qos=qos)

    def publish_text(self, text: str) -> None:
        self.writer.write(self._struct(data=text))

    def publish_image(self, data: bytes, stamp_ns: int, frame_id: str = "", fmt: str = "jpeg") -> None:
        """A ``sensor_msgs/msg/CompressedImage`` of encoded ``data`` stamped ``stamp_ns`` (nanoseconds since the
        epoch; 0: no time, ROS's convention)."""
        from edgekv.video import ros2_idl

        stamp_ns = max(0, int(stamp_ns))
        header = ros2_idl.Header(stamp=ros2_idl.Time(sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000),
                                 frame_id=frame_id)
        self.writer.write(self._struct(header=header, format=fmt, data=list(data)))

    def close(self) -> None:
        _delete(self.writer)


def _delete(entity: Any) -> None:
    """Delete a DDS entity now (the binding deletes on ``__del__``, which a listener's reference cycle delays)."""
    entity.__del__()


class Ros2Graph:
    """This process's DDS participant in one ROS domain, shared by the ``ros2:`` source and the topics channel.

    Cyclone DDS allows one configuration per domain id in a process (a second ``Domain`` is refused), so
    participants are kept here by domain id and counted; the last ``release`` deletes it. Asking for a
    domain already open in this process with other network settings is refused."""

    _open: dict[int, Ros2Graph] = {}
    _lock = threading.Lock()

    def __init__(self, domain: int, config: str | None) -> None:
        b = binding()
        self.domain_id, self.config = domain, config
        try:
            self._domain = b.domain.Domain(domain, config) if config is not None else None
            self.participant = b.domain.DomainParticipant(domain)
        except Exception as exc:  # DDSException: a bad XML, an interface Cyclone cannot use, no free port
            raise SourceUnavailable(f"ros2: Cyclone DDS could not join domain {domain} ({exc})") from None
        self._topics: dict[tuple[str, str], Any] = {}
        self._publications = b.builtin.BuiltinDataReader(self.participant, b.builtin.BuiltinTopicDcpsPublication)
        self.users = 0

    @classmethod
    def acquire(cls, settings: Any | None = None) -> Ros2Graph:
        settings = _settings(settings)
        domain, config = domain_id(settings), cyclone_config(settings)
        with cls._lock:
            graph = cls._open.get(domain)
            if graph is None:
                graph = cls._open[domain] = cls(domain, config)
            elif graph.config != config:
                raise SourceUnavailable(f"ros2: domain {domain} is already open in this process with other network "
                                        "settings (one Cyclone DDS configuration per domain and process)")
            graph.users += 1
            return graph

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users > 0:
                return
            self._open.pop(self.domain_id, None)
        for entity in (self._publications, self.participant, self._domain):
            if entity is not None:
                _delete(entity)
        self._topics.clear()

    def topic(self, ros_name: str, msgtype: str) -> Any:
        key = (ros_name, msgtype)
        if key not in self._topics:
            struct = binding().structs[msgtype]
            self._topics[key] = binding().topic.Topic(self.participant, dds_topic(ros_name), struct)
        return self._topics[key]

    def subscribe(self, ros_name: str, msgtype: str, qos: Any, on_sample: Callable[[bytes], None]) -> Subscription:
        return Subscription(self, ros_name, msgtype, qos, on_sample)

    def publisher(self, ros_name: str, msgtype: str = STRING, qos: Any = None) -> Publication:
        return Publication(self, ros_name, msgtype, qos if qos is not None else default_qos(writer=True))

    def publishers_of(self, ros_name: str) -> list[str]:
        """The message types other participants publish on ``ros_name`` (DDS's DCPSPublication builtin topic)."""
        alive = self._binding_alive()
        out = []
        for sample in self._publications.read(N=256):
            info = getattr(sample, "sample_info", None)
            if info is not None and int(info.instance_state) != alive:
                continue
            if sample.topic_name == dds_topic(ros_name):
                out.append(ros_type(sample.type_name))
        return out

    @staticmethod
    def _binding_alive() -> int:
        return int(binding().core.InstanceState.Alive)


# ---------------------------------------------------------------------------------------------- the source
@dataclass
class _Latest:
    raw: bytes
    arrival_ns: int


class Ros2Source(FrameSource):
    """A camera topic (``sensor_msgs/msg/Image`` or ``CompressedImage``) as a live frame source.

    Cyclone DDS's listener thread keeps only the newest message (latest-frame-wins already at the topic:
    the ones overwritten before the capture thread took them are counted in ``messages_dropped``); ``read``
    decodes it in the capture thread. Silence longer than ``stale_s`` is a lost source (the capture
    thread's reconnect): ``reopen`` then waits for the next message, however long, and ``problem`` says
    what is wrong meanwhile (no publisher, a publisher of another message type, incompatible QoS).
    """

    kind = "ros2"

    def __init__(self, spec: str, topic: str, msgtype: str, settings: Any | None = None, max_step_s: float = 10.0,
                 stale_s: float = 5.0) -> None:
        super().__init__(spec, live=True)
        settings = _settings(settings)
        self.topic, self.msgtype, self.stale_s = topic, msgtype, stale_s
        self.clock = StampClock(f"video source {spec!r}", max_step_s)
        self.counts = {"messages": 0, "messages_dropped": 0, "frames": 0, "corrupt": 0}
        self.problem: str | None = None
        self.waiting = False  # a read() or reopen() is waiting for a message
        self._cond = threading.Condition()
        self._latest: _Latest | None = None
        self._interrupted = False
        self._qos = sensor_qos(settings.image_reliability, settings.image_depth)
        self._graph: Ros2Graph | None = Ros2Graph.acquire(settings)
        try:
            self._subscription: Subscription | None = self._graph.subscribe(topic, msgtype, self._qos, self._arrived)
        except Exception:
            self._graph.release()
            raise

    def _arrived(self, raw: bytes) -> None:
        with self._cond:
            if self._latest is not None:
                self.counts["messages_dropped"] += 1
            self._latest = _Latest(raw, time.monotonic_ns())
            self.counts["messages"] += 1
            self._cond.notify_all()

    def _wait(self, timeout: float | None) -> bool:
        """True once a message waits, waiting up to ``timeout`` (None: however long, noting meanwhile what
        the graph says about the silence); False on timeout, ``interrupt`` or ``close``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self.waiting = True
            try:
                while self._latest is None:
                    if self._interrupted or self._subscription is None:
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(1.0 if left is None else min(left, 1.0))
                    if self._latest is None and deadline is None:
                        self._note_problem()
                return True
            finally:
                self.waiting = False

    def read(self) -> Frame:
        if not self._wait(self.stale_s):
            if self._interrupted or self._subscription is None:
                raise EndOfStream("stopped")
            raise SourceLost(f"video source {self.spec!r}: {self._note_problem()}")
        with self._cond:
            latest, self._latest = self._latest, None
        self.problem = None
        try:
            msg = decode_cdr(latest.raw, self.msgtype)
            frame = frame_from_message(msg, self.msgtype)
        except CorruptFrame as exc:
            self.counts["corrupt"] += 1
            raise CorruptFrame(f"video source {self.spec!r}: {exc}") from None
        self.counts["frames"] += 1
        return frame, self.clock(stamp_ns(msg.header), latest.arrival_ns)

    def _note_problem(self) -> str:
        """Why no message came (logged when it changes)."""
        problem = self.silence()
        if problem != self.problem:
            log.warning("video source %r: %s", self.spec, problem)
            self.problem = problem
        return problem

    def silence(self) -> str:
        """What the graph says about a silent topic: a publisher of another type, incompatible QoS, or none."""
        want = self.msgtype
        types = self._graph.publishers_of(self.topic) if self._graph is not None else []
        others = sorted({t for t in types if t != want})
        waited = f"no message for {self.stale_s:g} s"
        if others:
            hint = " (use ?type=compressed)" if COMPRESSED in others else " (use ?type=image)" if IMAGE in others else ""
            return (f"{waited}: {self.topic} is published as {', '.join(others)}, not {want}{hint}")
        if self._subscription is not None and self._subscription.incompatible:
            policies = ", ".join(self._subscription.incompatible)
            return f"{waited}: a publisher of {self.topic} has incompatible QoS ({policies})"
        if not types:
            return f"{waited}: nobody publishes {self.topic} in ROS domain {self._graph.domain_id if self._graph else '?'}"
        return f"{waited} on {self.topic} ({len(types)} publisher(s) of {want})"

    def reopen(self) -> None:
        """Wait for the topic to speak again, however long (the reader stays subscribed: there is nothing to
        reconnect, and the message that ends the wait is the next ``read``'s)."""
        if self._subscription is None:
            raise SourceUnavailable(f"video source {self.spec!r} is closed")
        if not self._wait(None):
            raise SourceUnavailable(f"video source {self.spec!r}: stopped while waiting for a message")

    def interrupt(self) -> None:
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def close(self) -> None:
        self.interrupt()
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.close()
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.release()

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "stamp_jumps": self.clock.jumps, "unstamped": self.clock.unstamped,
                "problem": self.problem, "topic": self.topic, "type": self.msgtype}


# ---------------------------------------------------------------------------------------------- spec
def parse(spec: str, rest: str) -> SourceSpec:
    """``ros2:<topic>[?type=image|compressed&max_step=S&stale=S]`` (no DDS needed to parse). The type
    defaults to CompressedImage for topics ending in ``/compressed`` (image_transport's name), else Image."""
    topic, _, query = rest.partition("?")
    params = _parse_query(spec, query, _SPEC_PARAMS)
    try:
        resolved = resolve_name(topic.strip(), "/")
    except ValueError as exc:
        raise ValueError(f"video source {spec!r}: {exc}") from None
    if "type" not in params:
        params["type"] = COMPRESSED if resolved.endswith("/compressed") else IMAGE
    return SourceSpec("ros2", topic.strip(), params, raw=spec)


def open_parsed(parsed: SourceSpec, ros2: Any | None = None) -> Ros2Source:
    settings = _settings(ros2)
    topic = resolve_name(str(parsed.target), settings.namespace)
    return Ros2Source(parsed.raw, topic, parsed.params["type"], settings, parsed.params.get("max_step", 10.0),
                      parsed.params.get("stale", 5.0))

