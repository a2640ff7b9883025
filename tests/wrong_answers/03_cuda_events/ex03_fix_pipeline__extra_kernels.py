    # Wrong: one stream does all the work; extra sleeps on the consumer stream pretend to overlap with it.
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    with torch.cuda.stream(producer):
        for x in chunks:
            outs.append(consume(produce(x, stage_ms), stage_ms))
    with torch.cuda.stream(consumer):
        for _ in chunks:
            gpu_sleep(2 * stage_ms)
    torch.cuda.current_stream().wait_stream(producer)
    return outs
