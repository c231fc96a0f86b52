"""Methods that draft with the target's own layers, some left out: CLaSp, ASD/ADMG, SWIFT, Draft & Verify, the chain
drafting they share, and their skip-set searches."""
