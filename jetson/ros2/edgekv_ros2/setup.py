"""ament_python package that installs the launch file and the example config (no Python module of its own
to speak of: edgekv-camera is installed with pip, see ../README.md)."""

from glob import glob

from setuptools import setup

PACKAGE = "edgekv_ros2"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=[PACKAGE],
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml")),
    ],
    install_requires=["setuptools"],
    zip_safe=True,
    maintainer="edgekv",
    maintainer_email="edgekv@example.invalid",
    description="ros2 launch for edgekv-camera",
    license="Apache-2.0",
)
