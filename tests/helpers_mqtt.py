"""A real MQTT broker for the fleet tests: Debian's Mosquitto, started with a config file of the test's own and
stopped by it (``.ci/run`` installs the package; tests skip with the reason where it is missing), and network
namespaces for devices on their own links."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from helpers_wait import until  # noqa: F401 (the fleet tests import it from here)

# The fleet's streams: device -> (synthetic:events seed, the circle's colour, the frame pairs it is on), from
# edgekv.video.events' ground truth of these scenes (each has one circle; the toy names its colour).
STREAMS = {"cam-red": (5, "red", (11, 12)), "cam-green": (2, "green", (12, 13)), "cam-blue": (28, "blue", (15, 16))}
QUESTION = "What color was the circle?"


def stream(seed: int) -> str:
    return f"synthetic:events?size=112x112&fps=2&frames=48&seed={seed}&rate=0.15&noise=3"


MOSQUITTO = shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto",) if os.access(p, os.X_OK)), None)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def need_mosquitto() -> str:
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run does it in CI)")
    pytest.importorskip("paho.mqtt.client", reason="paho-mqtt is not installed (pip install 'edgekv[fleet]')")
    return MOSQUITTO


class Mosquitto:
    """``mosquitto -c <file>`` listening on ``addresses`` (loopback by default), one port; ``users`` gives it a
    password file and refuses anonymous clients. ``tls`` = (ca, cert, key) adds an mqtts:// listener."""

    def __init__(self, directory: Path, addresses: tuple[str, ...] = ("127.0.0.1",), users: dict | None = None,
                 tls: tuple[Path, Path, Path] | None = None, port: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.binary = need_mosquitto()
        self.directory, self.addresses, self.users, self.tls = Path(directory), addresses, users, tls
        self.extra = extra  # further lines of mosquitto.conf (``sys_interval 0``: no $SYS topics)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.tls_port = free_port() if tls else None
        self.log = self.directory / "mosquitto.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        lines = ["per_listener_settings false", "persistence false", "user root", f"log_dest file {self.log}",
                 "log_type error", "log_type warning", "log_type notice", "log_type information"]
        for address in self.addresses:
            lines.append(f"listener {self.port} {address}")
        if self.tls is not None:
            ca, cert, key = self.tls
            lines += [f"listener {self.tls_port} 127.0.0.1", f"cafile {ca}", f"certfile {cert}", f"keyfile {key}"]
        if self.users is not None:
            passwords = self.directory / "passwords"
            passwords.write_text("")
            for user, password in self.users.items():
                subprocess.run(["mosquitto_passwd", "-b", str(passwords), user, password], check=True,
                               capture_output=True)
            lines += ["allow_anonymous false", f"password_file {passwords}"]
        else:
            lines.append("allow_anonymous true")
        return "\n".join(lines + list(self.extra)) + "\n"

    def start(self) -> "Mosquitto":
        config = self.directory / "mosquitto.conf"
        config.write_text(self.config_text())
        self.process = subprocess.Popen([self.binary, "-c", str(config)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        ports = [(a, self.port) for a in self.addresses] + ([("127.0.0.1", self.tls_port)] if self.tls else [])
        if not until(lambda: self.process.poll() is not None or all(_accepts(*p) for p in ports), 30):
            self.stop()
            raise RuntimeError(f"mosquitto did not listen on {ports} within 30 s: {self._tail()}")
        if self.process.poll() is not None:
            raise RuntimeError(f"mosquitto exited ({self.process.returncode}): {self._tail()}")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()

    def _tail(self) -> str:
        text = self.log.read_text() if self.log.exists() else ""
        if self.process is not None and self.process.stderr is not None and self.process.poll() is not None:
            text += self.process.stderr.read().decode(errors="replace")
        return text[-2000:]

    def __enter__(self) -> "Mosquitto":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class Listener:
    """A plain paho client subscribed to ``topics``: every message kept as (topic, payload, properties)."""

    def __init__(self, url: str, topics: list[str], username: str | None = None, password: str | None = None):
        import paho.mqtt.client as mqtt

        from edgekv.config import broker_address

        host, port, _ = broker_address(url)
        self.messages: list[tuple[str, bytes, object, bool]] = []
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_message = lambda c, u, m: self.messages.append((m.topic, m.payload, m.properties, m.retain))
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_connect = lambda c, u, f, reason, p: c.subscribe([(t, 1) for t in topics])
        self.client.connect(host, port)
        self.client.loop_start()
        assert self._subscribed.wait(30), "the listener's subscription was not confirmed"

    def json_on(self, suffix: str) -> list[dict]:
        return [json.loads(p) for t, p, _, _ in list(self.messages) if t.endswith(suffix) and p]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def publish_raw(url: str, topic: str, payload: bytes, response_topic: str | None = None,
                correlation: bytes | None = None, user_properties: list[tuple[str, str]] | None = None,
                retain: bool = False, expiry_s: int | None = None) -> None:
    """One message as a careless or hostile client would send it (QoS 1, waits for the broker's PUBACK)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from edgekv.config import broker_address

    host, port, _ = broker_address(url)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect(host, port)
    client.loop_start()
    try:
        properties = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            properties.ResponseTopic = response_topic
        if correlation is not None:
            properties.CorrelationData = correlation
        if user_properties:
            properties.UserProperty = list(user_properties)
        if expiry_s is not None:
            properties.MessageExpiryInterval = expiry_s
        client.publish(topic, payload, qos=1, retain=retain, properties=properties).wait_for_publish(30)
    finally:
        client.disconnect()
        client.loop_stop()


class _Proxy:
    """A TCP proxy on 127.0.0.1 in front of the broker: each connection accepted (``accepted`` counts them) is
    joined to one of its own to the broker, and the subclass's ``_join(client, upstream)`` starts what carries their
    bytes."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.accepted = 0
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def _admits(self) -> bool:
        return True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if not self._admits():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)  # the connect's timeout would end a link idle for 10 s (a frozen one too)
            with self._lock:
                self._sockets += [client, upstream]
                self.accepted += 1
            self._join(client, upstream)


class Relay(_Proxy):
    """A TCP relay on 127.0.0.1 in front of the broker: ``cut()`` drops every connection through it and refuses
    new ones (a device's link gone, the broker still up for everyone else), ``restore()`` lets them through;
    ``freeze()`` keeps the connections open and forwards nothing (a half-open link: the broker notices it only
    after the keep-alive, so the device's last will waits that long)."""

    def __init__(self, target_port: int) -> None:
        self.open = True
        self.frozen = False
        super().__init__(target_port)

    def _admits(self) -> bool:
        return self.open

    def _join(self, client: socket.socket, upstream: socket.socket) -> None:
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self.frozen:
                    sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.open = False
        with self._lock:
            sockets, self._sockets = self._sockets, []
        _close(*sockets)

    def restore(self) -> None:
        self.open = True

    def freeze(self) -> None:
        self.frozen = True

    def close(self) -> None:
        self.cut()
        self.server.close()


def mqtt_packets(buffer: bytearray) -> list[bytes]:
    """Take the whole MQTT control packets off the front of ``buffer`` (fixed header: a type byte, then the Remaining
    Length as a variable byte integer, MQTT 5.0 §2.1.4); a partial one stays for the next read."""
    packets = []
    while len(buffer) >= 2:
        length, shift, at = 0, 0, 1
        while at < len(buffer) and at <= 4:
            byte = buffer[at]
            length += (byte & 0x7F) << shift
            shift, at = shift + 7, at + 1
            if not byte & 0x80:
                break
        else:
            return packets  # the length's bytes are not all in yet
        if buffer[at - 1] & 0x80 or len(buffer) < at + length:
            return packets
        packets.append(bytes(buffer[:at + length]))
        del buffer[:at + length]
    return packets


class PacketProxy(_Proxy):
    """An MQTT-aware TCP proxy on 127.0.0.1 in front of the broker, read packet by packet, for brokers that behave as
    the specification allows but Mosquitto does not:

    - ``hold_retained``: every retained PUBLISH the broker sends a client (what a new subscription's retained
      messages are, MQTT 5.0 §3.3.1.3) is held back until the broker has sent that client a PUBLISH that is not
      retained, and then sent right after it: retained messages arriving after the SUBACK and after a message
      published later on another topic, as HiveMQ (after the SUBACK is written, in batches) and EMQX (from another
      process) deliver them, while the order of everything else is kept;
    - ``cut_first_subscribe``: the first SUBSCRIBE through it is not forwarded and its connection is closed (the
      broker lost before the SUBACK); later connections pass untouched.

    ``held`` counts the packets held back, ``accepted`` the connections."""

    def __init__(self, target_port: int, hold_retained: bool = False, cut_first_subscribe: bool = False) -> None:
        self.hold_retained, self.cut_first_subscribe = hold_retained, cut_first_subscribe
        self.held = 0
        self.cut = 0
        super().__init__(target_port)

    def _join(self, client: socket.socket, upstream: socket.socket) -> None:
        threading.Thread(target=self._to_broker, args=(client, upstream), daemon=True).start()
        threading.Thread(target=self._to_client, args=(upstream, client), daemon=True).start()

    def _to_broker(self, client: socket.socket, upstream: socket.socket) -> None:
        buffer = bytearray()
        try:
            while data := client.recv(65536):
                buffer += data
                for packet in mqtt_packets(buffer):
                    if packet[0] >> 4 == 8 and self.cut_first_subscribe:  # SUBSCRIBE
                        with self._lock:
                            first, self.cut_first_subscribe = True, False
                            self.cut += 1
                        if first:
                            raise OSError("the first SUBSCRIBE: the broker is lost before its SUBACK")
                    upstream.sendall(packet)
        except OSError:
            pass
        _close(client, upstream)

    def _to_client(self, upstream: socket.socket, client: socket.socket) -> None:
        buffer, held, released = bytearray(), [], not self.hold_retained
        try:
            while data := upstream.recv(65536):
                buffer += data
                for packet in mqtt_packets(buffer):
                    publish, retained = packet[0] >> 4 == 3, bool(packet[0] & 0x01)
                    if not released and publish and retained:
                        held.append(packet)
                        with self._lock:
                            self.held += 1
                        continue
                    client.sendall(packet)
                    if not released and publish:  # a later message on another topic went first: now the held ones
                        released = True
                        for late in held:
                            client.sendall(late)
                        held.clear()
        except OSError:
            pass
        _close(upstream, client)

    def close(self) -> None:
        self.server.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        _close(*sockets)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


# ---------------------------------------------------------------------------------------------- namespaces
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def need_netns() -> None:
    """Skip unless this process may create network namespaces (root with CAP_SYS_ADMIN and CAP_NET_ADMIN)."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip is not installed")
    probe = f"ekvprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        pytest.skip(f"ip netns is not permitted here: {made.stderr.strip() or made.stdout.strip()}")
    _ip("netns", "delete", probe, check=False)


def free_subnet() -> str:
    """A private /24 (``10.x.y``) that no route or address on this machine overlaps."""
    import ipaddress
    import re

    text = _ip("-4", "route", "show", "table", "all").stdout + _ip("-4", "addr").stdout
    used = [ipaddress.ip_network(m, strict=False) for m in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", text)]
    for second in range(200, 250):
        for third in range(0, 256, 17):
            candidate = ipaddress.ip_network(f"10.{second}.{third}.0/24")
            if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
                return f"10.{second}.{third}"
    raise RuntimeError("no free 10.x.y.0/24 for the test's links")


class Namespaces:
    """``count`` network namespaces, each linked to this (root) namespace by a veth pair carved out of one
    private /24: link i is 10.x.y.(4i)/30 with the host end at .4i+1 and the device end at .4i+2. Created by
    ``create`` and removed (with their veths) by ``delete``, which is safe to call after a partial create."""

    def __init__(self, count: int) -> None:
        self.tag = f"{os.getpid() % 100000}"
        self.names = [f"ekv{self.tag}n{i}" for i in range(count)]
        self.host_ends = [f"ekv{self.tag}h{i}" for i in range(count)]   # <= 15 characters: an interface name
        self.device_ends = [f"ekv{self.tag}d{i}" for i in range(count)]
        self.subnet = free_subnet()
        self.host_addresses = [f"{self.subnet}.{4 * i + 1}" for i in range(count)]
        self.device_addresses = [f"{self.subnet}.{4 * i + 2}" for i in range(count)]

    def create(self) -> "Namespaces":
        for name, host, device, host_ip, device_ip in zip(self.names, self.host_ends, self.device_ends,
                                                          self.host_addresses, self.device_addresses):
            _ip("netns", "add", name)
            _ip("link", "add", host, "type", "veth", "peer", "name", device)
            _ip("link", "set", device, "netns", name)
            _ip("addr", "add", f"{host_ip}/30", "dev", host)
            _ip("link", "set", host, "up")
            _ip("-n", name, "addr", "add", f"{device_ip}/30", "dev", device)
            _ip("-n", name, "link", "set", device, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        return self

    def cut(self, index: int) -> None:
        _ip("link", "set", self.host_ends[index], "down")

    def restore(self, index: int) -> None:
        _ip("link", "set", self.host_ends[index], "up")

    def exec_prefix(self, index: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[index]]

    def delete(self) -> None:
        for host in self.host_ends:  # deleting one end of a veth deletes both
            _ip("link", "delete", host, check=False)
        for name in self.names:
            _ip("netns", "delete", name, check=False)

    def __enter__(self) -> "Namespaces":
        try:
            return self.create()
        except BaseException:
            self.delete()
            raise

    def __exit__(self, *exc) -> None:
        self.delete()


def returns_early(ask, bound_s: float = 300.0):
    """``ask()`` in a thread, its result once it returns within ``bound_s`` (far below the asker's own timeout):
    an asker that waited its timeout out fails the test."""
    results: list = []
    asker = threading.Thread(target=lambda: results.append(ask()), daemon=True)
    asker.start()
    asker.join(bound_s)
    assert not asker.is_alive(), "the asker waited out its timeout"
    return results[0]
