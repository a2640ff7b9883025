    ### BEGIN SOLUTION
    # Wrong: algbw, not busbw.
    return max(input_bytes, output_bytes) / seconds / 1e9
    ### END SOLUTION
