    # Wrong: adds all of a's kernel as waiting time, though it ran while b did its own work.
    return b1_ms + a_ms + b2_ms
