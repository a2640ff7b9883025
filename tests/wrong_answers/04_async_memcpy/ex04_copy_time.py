    ### BEGIN SOLUTION
    # Wrong: least squares on the times themselves (np.polyfit), so the largest copies' noise sets t0.
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(times_ms, dtype=float) / 1e3, 1)
    return intercept * 1e6, 1 / slope / 1e9
    ### END SOLUTION
