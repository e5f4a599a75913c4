"""Processes and their lifecycles: child processes (named, watched through a pidfd, ended
TERM-then-KILL), the zygote and its handle, instance slots, the restart policy and its backoff, and
memory facts from /proc and nvidia-smi (never a CUDA context)."""
