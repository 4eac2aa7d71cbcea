"""The ROS 2 messages edgekv exchanges over DDS, as Cyclone DDS IDL structs (imported only with the ``ros2`` extra).

Each struct is the message's .msg fields in order under its DDS name (``sensor_msgs::msg::dds_::Image_``:
rosidl_generator_dds_idl's mapping; ``uint8[]`` is ``sequence<uint8>``). Writers serialize through the
binding; readers keep each sample's serialized bytes (``deserialize`` returns ``Serialized``), which
``edgekv.video.ros_images`` decodes with rosbags, so a malformed sample is one counted skip.

No ``from __future__ import annotations`` here: the binding resolves field types from the annotations
themselves, and structs must live at module level for it to find the nested ones.
"""

from dataclasses import dataclass, field
from typing import Optional

from cyclonedds.idl import IdlStruct
from cyclonedds.idl.types import int32, sequence, uint8, uint32


class Serialized:
    """A sample as it came off the wire: encapsulation header + CDR."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def _keep_serialized(cls: type, data: bytes, has_header: bool = True, use_version_2: Optional[bool] = None) -> Serialized:
    """Replaces ``deserialize`` of the structs below, so the binding's reader hands back the bytes. (Set after
    the class is made: the binding reads a struct's base classes as IDL inheritance, so no mixin.)"""
    return Serialized(bytes(data))


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


for _struct in (Image, CompressedImage, String):
    _struct.deserialize = classmethod(_keep_serialized)

STRUCTS = {"sensor_msgs/msg/Image": Image, "sensor_msgs/msg/CompressedImage": CompressedImage,
           "std_msgs/msg/String": String}
