"""A node as one of several: its registration in etcd and its router's link to the cluster's roles
(docs/cluster.md). Relaunch stays local (the supervisor's); the cluster only decides roles."""
