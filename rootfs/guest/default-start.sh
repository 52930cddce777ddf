# The default template's start command (/etc/hutch/start), run by init before the agent:
# Python's stdlib imported once with -B (nothing written), so every VM restored from the
# pristine snapshot starts Python warm. HUTCH_PRELOAD comes from hutch.preload= (0 skips).
exec python3 -B -I /etc/hutch/boot.py
