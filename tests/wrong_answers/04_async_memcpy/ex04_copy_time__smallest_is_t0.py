    ### BEGIN SOLUTION
    # Wrong: t0 is the smallest copy's time, as if that copy moved no bytes (the rate, from the two largest
    # copies, is right).
    slope_ms_per_byte = (times_ms[-1] - times_ms[-2]) / (sizes[-1] - sizes[-2])
    return times_ms[0] * 1e3, 1 / (slope_ms_per_byte / 1e3) / 1e9
    ### END SOLUTION
