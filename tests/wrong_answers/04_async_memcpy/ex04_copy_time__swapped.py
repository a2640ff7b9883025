    ### BEGIN SOLUTION
    # Wrong: the two numbers in the other order.
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times_ms, dtype=float) / 1e3
    rows = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (t0_s, s_per_byte), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    return 1 / s_per_byte / 1e9, t0_s * 1e6
    ### END SOLUTION
