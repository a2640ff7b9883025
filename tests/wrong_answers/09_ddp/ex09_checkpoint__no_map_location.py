        ### BEGIN SOLUTION
        # Wrong: no map_location: on GPUs every rank's copy would land on the GPU that saved it.
        if dist.get_rank() == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       path)
        dist.barrier()
        ### NEXT SOLUTION
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["epoch"]
        ### END SOLUTION
