"""Engine core: scheduler, batch building, model runner, sampler and the step loop."""
