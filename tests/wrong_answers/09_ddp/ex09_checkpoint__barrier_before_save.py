        ### BEGIN SOLUTION
        # Wrong: the barrier comes before the write, so the other ranks do not wait for the file.
        dist.barrier()
        if dist.get_rank() == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       path)
        ### NEXT SOLUTION
        state = torch.load(path, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["epoch"]
        ### END SOLUTION
