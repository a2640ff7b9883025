    ### BEGIN SOLUTION
    # Wrong: the rate in GiB/s (2**30 bytes), where the course's GB/s is 10**9.
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times_ms, dtype=float) / 1e3
    rows = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (t0_s, s_per_byte), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    return t0_s * 1e6, 1 / s_per_byte / 2**30
    ### END SOLUTION
