"""Nothing to import: this ROS 2 package only carries a launch file and an example config for edgekv-camera."""
