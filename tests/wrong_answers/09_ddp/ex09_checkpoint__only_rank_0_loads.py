        ### BEGIN SOLUTION
        # Wrong: only rank 0 loads; the others go on with whatever weights they had.
        if dist.get_rank() == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       path)
        dist.barrier()
        ### NEXT SOLUTION
        state = torch.load(path, map_location=device)
        if dist.get_rank() == 0:
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        return state["epoch"]
        ### END SOLUTION
