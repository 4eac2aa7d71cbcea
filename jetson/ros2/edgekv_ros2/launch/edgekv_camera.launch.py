"""ros2 launch edgekv_ros2 edgekv_camera.launch.py [camera_topic:=/front/image_raw] [namespace:=/edgekv]
[config:=/path/to/deploy.yaml]

Starts edgekv-camera as a process (it is not an rclpy node: it joins the ROS graph through Cyclone DDS on
its own, so the robot's RMW needs no change) with the camera topic and namespace given here. ROS_DOMAIN_ID
is inherited from the environment, as every ROS 2 node does.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess
from launch.substitutions import LaunchConfiguration


def generate_launch_description():
    share = get_package_share_directory("edgekv_ros2")
    arguments = [
        DeclareLaunchArgument("config", default_value=os.path.join(share, "config", "robot.yaml"),
                              description="edgekv deployment YAML"),
        DeclareLaunchArgument("camera_topic", default_value="/camera/image_raw",
                              description="sensor_msgs/Image or CompressedImage topic to watch"),
        DeclareLaunchArgument("namespace", default_value="/edgekv",
                              description="namespace of input_query, output, output_stream, output_json, "
                                          "output_evidence, status"),
        DeclareLaunchArgument("executable", default_value="edgekv-camera",
                              description="edgekv-camera of the venv edgekv is installed in"),
    ]
    camera = ExecuteProcess(
        cmd=[LaunchConfiguration("executable"), "--config", LaunchConfiguration("config"), "--no-stdin",
             "--source", ["ros2:", LaunchConfiguration("camera_topic")],
             "--set", "ros2.enabled=true", "--set", ["ros2.namespace=", LaunchConfiguration("namespace")]],
        name="edgekv_camera", output="screen", sigterm_timeout="20")
    return LaunchDescription(arguments + [camera])
