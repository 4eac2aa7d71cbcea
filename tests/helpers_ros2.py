"""A stand-in robot for the ROS 2 tests, written directly against Cyclone DDS's Python binding and ROS 2's
conventions, with none of edgekv's ROS code (edgekv/video/ros2*.py, apps/outputs/ros2.py): the other side
of the wire is an independent implementation of it.

Run as a script in its own process (``python tests/helpers_ros2.py --domain D --out result.json ...``), it
joins the ROS domain on loopback (explicit peer, no multicast), streams a video as ``sensor_msgs/msg/Image``
(or ``CompressedImage``) at a fixed rate with ``header.stamp`` = the video's own time, can slip in bad
messages (a wrong encoding, a truncated message), asks questions on the question topic and records what
comes back on the answer, token, status, JSON answer and evidence image topics. The frames come from edgekv's
``synthetic:`` sources (the ground truth); everything on the wire is this file's.
"""

from dataclasses import dataclass, field

try:  # the pytest process imports this file only for its constants; the binding is needed by the script
    from cyclonedds.idl import IdlStruct
    from cyclonedds.idl.types import int32, sequence, uint8, uint32
except ImportError:  # pragma: no cover - the tests importorskip cyclonedds first
    IdlStruct = object

STAMP_BASE_S = 1_700_000_000


def loopback_config(max_participants: int = 20) -> str:
    """Cyclone DDS on loopback only: unicast discovery to 127.0.0.1, multicast off."""
    return ('<CycloneDDS><Domain id="any"><General><Interfaces><NetworkInterface name="lo"/></Interfaces>'
            '<AllowMulticast>false</AllowMulticast></General><Discovery><ParticipantIndex>auto</ParticipantIndex>'
            f'<MaxAutoParticipantIndex>{max_participants}</MaxAutoParticipantIndex>'
            '<Peers><Peer address="127.0.0.1"/></Peers></Discovery></Domain></CycloneDDS>')


if IdlStruct is not object:
    @dataclass
    class Time(IdlStruct, typename="builtin_interfaces::msg::dds_::Time_"):
        sec: int32 = 0
        nanosec: uint32 = 0

    @dataclass
    class Header(IdlStruct, typename="std_msgs::msg::dds_::Header_"):
        stamp: Time = field(default_factory=Time)
        frame_id: str = ""

    @dataclass
    class Image(IdlStruct, typename="sensor_msgs::msg::dds_::Image_"):
        header: Header = field(default_factory=Header)
        height: uint32 = 0
        width: uint32 = 0
        encoding: str = ""
        is_bigendian: uint8 = 0
        step: uint32 = 0
        data: sequence[uint8] = field(default_factory=list)

    @dataclass
    class CompressedImage(IdlStruct, typename="sensor_msgs::msg::dds_::CompressedImage_"):
        header: Header = field(default_factory=Header)
        format: str = ""
        data: sequence[uint8] = field(default_factory=list)

    @dataclass
    class String(IdlStruct, typename="std_msgs::msg::dds_::String_"):
        data: str = ""


def image_message(frame, t: float, encoding: str):
    """The message a camera driver would publish for a BGR ``frame`` at video time ``t``."""
    import cv2
    import numpy as np

    stamp = STAMP_BASE_S * 1_000_000_000 + round(t * 1e9)
    header = Header(stamp=Time(sec=stamp // 1_000_000_000, nanosec=stamp % 1_000_000_000), frame_id="camera")
    if encoding in ("jpeg", "png"):
        ok, data = cv2.imencode(".jpg" if encoding == "jpeg" else ".png", frame)
        return CompressedImage(header=header, format=encoding, data=list(data.reshape(-1).tobytes()))
    pixels = {"bgr8": frame, "rgb8": frame[:, :, ::-1], "mono8": None}.get(encoding)
    if encoding == "mono8":
        pixels = cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    elif pixels is None:  # an encoding nobody decodes (the bad-input case): bytes of the right size
        pixels = np.zeros((frame.shape[0], frame.shape[1], 4), dtype=np.float32)
    pixels = np.ascontiguousarray(pixels)
    return Image(header=header, height=pixels.shape[0], width=pixels.shape[1], encoding=encoding, is_bigendian=0,
                 step=pixels.strides[0], data=list(pixels.reshape(-1).view(np.uint8).tobytes()))


def main() -> int:
    import argparse
    import json
    import time

    from cyclonedds.domain import Domain, DomainParticipant
    from cyclonedds.pub import DataWriter
    from cyclonedds.qos import Policy, Qos
    from cyclonedds.sub import DataReader
    from cyclonedds.topic import Topic

    from edgekv.video.sources import open_source

    parser = argparse.ArgumentParser()
    parser.add_argument("--domain", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--spec", default="synthetic:events?size=112x112&fps=10&frames=40&seed=3&rate=0.1&duration=2-3")
    parser.add_argument("--topic", default="/camera/image_raw")
    parser.add_argument("--namespace", default="/edgekv")
    parser.add_argument("--encoding", default="rgb8")
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--bad", action="append", default=[], metavar="INDEX:KIND",
                        help="replace message INDEX by a bad one: encoding (32FC1), truncated (half the pixel data), string "
                             "(a std_msgs/String on the image topic)")
    parser.add_argument("--ask", action="append", default=[], help="questions, asked once every frame was ingested")
    parser.add_argument("--alerts", type=int, default=0, help="wait for this many alerts (and their keyframes)")
    parser.add_argument("--forget", action="append", default=[],
                        help="forget requests, published after the questions, each waited for")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()

    domain = Domain(args.domain, loopback_config())
    participant = DomainParticipant(args.domain)
    sensor = Qos(Policy.Reliability.BestEffort, Policy.History.KeepLast(5), Policy.Durability.Volatile)
    reliable = Qos(Policy.Reliability.Reliable(max_blocking_time=0), Policy.History.KeepLast(10),
                   Policy.Durability.Volatile, Policy.DataRepresentation(use_cdrv0_representation=True))
    image_type = CompressedImage if args.encoding in ("jpeg", "png") else Image
    images = DataWriter(participant, Topic(participant, "rt" + args.topic, image_type), qos=sensor)
    bad = dict(item.split(":", 1) for item in args.bad)
    wrong = None
    if "string" in bad.values():  # another participant's String writer on the image topic
        other = DomainParticipant(args.domain)
        wrong = DataWriter(other, Topic(other, "rt" + args.topic, String), qos=reliable)
    ns = args.namespace.rstrip("/")
    questions = DataWriter(participant, Topic(participant, f"rt{ns}/input_query", String), qos=reliable)
    answers = DataReader(participant, Topic(participant, f"rt{ns}/output", String), qos=reliable)
    tokens = DataReader(participant, Topic(participant, f"rt{ns}/output_stream", String), qos=reliable)
    status = DataReader(participant, Topic(participant, f"rt{ns}/status", String), qos=reliable)
    answers_json = DataReader(participant, Topic(participant, f"rt{ns}/output_json", String), qos=reliable)
    evidence = DataReader(participant, Topic(participant, f"rt{ns}/output_evidence", CompressedImage), qos=reliable)
    alerts = DataReader(participant, Topic(participant, f"rt{ns}/alerts", String), qos=reliable)
    alert_images = DataReader(participant, Topic(participant, f"rt{ns}/alert_image", CompressedImage), qos=reliable)
    forgets = DataWriter(participant, Topic(participant, f"rt{ns}/input_forget", String), qos=reliable)
    forgotten = DataReader(participant, Topic(participant, f"rt{ns}/output_forget", String), qos=reliable)
    result = {"published": 0, "first_serialized": None, "answers": [], "tokens": [], "status": [], "json": [],
              "evidence": [], "alerts": [], "alert_images": [], "forgotten": [], "errors": []}
    deadline = time.monotonic() + args.timeout

    def drain() -> None:
        for reader, key in ((answers, "answers"), (tokens, "tokens"), (status, "status"), (answers_json, "json"),
                            (forgotten, "forgotten")):
            for sample in reader.take(N=64):
                result[key].append(sample.data)
        for sample in alerts.take(N=16):
            result["alerts"].append(sample.data)
        for reader, key in ((evidence, "evidence"), (alert_images, "alert_images")):
            for sample in reader.take(N=16):
                result[key].append({"sec": sample.header.stamp.sec, "nanosec": sample.header.stamp.nanosec,
                                    "frame_id": sample.header.frame_id, "format": sample.format,
                                    "data": bytes(sample.data).hex()})

    def wait(condition, what: str) -> bool:
        while time.monotonic() < deadline:
            drain()
            if condition():
                return True
            time.sleep(0.02)
        result["errors"].append(f"timed out waiting for {what}")
        return False

    if wait(lambda: (images.get_matched_subscriptions() or (wrong and wrong.get_matched_subscriptions()))
            and (not args.alerts or (alerts.get_matched_publications() and alert_images.get_matched_publications())),
            "a reader of the image topic (and the alert topics' writers)"):
        source = open_source(args.spec)
        period, start = 1.0 / args.rate, time.monotonic()
        for index, (frame, t) in enumerate(source):
            kind = bad.get(str(index))
            message = image_message(frame, t, "32FC1" if kind == "encoding" else args.encoding)
            if index == 0:
                result["first_serialized"] = message.serialize().hex()
                result["first_t"] = t
            if kind == "truncated":  # an image cut short: less data than step x height (the CDR itself is
                # well formed: Cyclone DDS refuses to write a sample whose CDR is cut, DDS_RETCODE_BAD_PARAMETER)
                message.data = message.data[:len(message.data) // 2]
            if kind == "string":
                wrong.write(String(data="not an image"))
            else:
                images.write(message)
            result["published"] += 1
            time.sleep(max(0.0, start + (index + 1) * period - time.monotonic()))
            drain()
        source.close()
    total = result["published"]

    def ingested() -> bool:  # every message the camera sent was ingested or dropped as the latest-frame rule says
        if not result["status"]:
            return False
        last = json.loads(result["status"][-1])
        src = last.get("source") or {}
        settled = (last["cache"]["frames"] or 0) + (last["capture"]["frames_dropped"] or 0) \
            + src.get("messages_dropped", 0) + src.get("corrupt", 0)
        return settled >= total - len([k for k in bad.values() if k == "string"])

    if args.ask and wait(ingested, "the daemon to ingest every frame") and wait(
            lambda: questions.get_matched_subscriptions() and answers.get_matched_publications(),
            "the question and answer topics"):
        for question in args.ask:
            have = len(result["answers"])
            questions.write(String(data=question))
            wait(lambda: len(result["answers"]) > have, f"the answer to {question!r}")
            wait(lambda: len(result["json"]) > have, f"the JSON answer to {question!r}")
        seen = len(result["status"])
        wait(lambda: len(result["status"]) > seen, "a status message after the answers")
    if args.forget and wait(ingested, "the daemon to ingest every frame") and wait(
            lambda: forgets.get_matched_subscriptions() and forgotten.get_matched_publications(),
            "the forget topics"):
        for request in args.forget:
            have = len(result["forgotten"])
            forgets.write(String(data=request))
            wait(lambda: len(result["forgotten"]) > have, f"the result of forget {request!r}")
    if args.alerts:
        wait(lambda: len(result["alerts"]) >= args.alerts and len(result["alert_images"]) >= args.alerts,
             f"{args.alerts} alert(s) and their keyframes")
    drain()
    with open(args.out, "w") as out:
        json.dump(result, out)
    del domain
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
