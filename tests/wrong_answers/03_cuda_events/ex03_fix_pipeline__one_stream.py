    # Wrong: right results, but both stages run on the producer stream, so nothing overlaps.
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    with torch.cuda.stream(producer):
        for x in chunks:
            outs.append(consume(produce(x, stage_ms), stage_ms))
    torch.cuda.current_stream().wait_stream(producer)
    return outs
