    ### BEGIN SOLUTION
    # Wrong: t0 is the smallest copy's time and the rate the largest copy's size over its time, as if each
    # copy held one term of the model alone (the largest still holds t0 when the sweep stops near the knee).
    return times_ms[0] * 1e3, sizes[-1] / (times_ms[-1] / 1e3) / 1e9
    ### END SOLUTION
