"""Child processes: named, watched through a pidfd, ended TERM-then-KILL; the zygote and its handle;
the restart policy; GPU facts from nvidia-smi (never a CUDA context)."""
