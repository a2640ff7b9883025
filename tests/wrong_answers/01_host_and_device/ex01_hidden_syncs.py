    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    acc = (out.argmax(dim=1) == y).float().mean()
    # Half fixed: loss and accuracy stay on the device, but float() still reads the norm every step.
    history.append({"loss": loss.detach(), "grad_norm": float(grad_norm), "acc": acc})
