"""Generate tiny synthetic datasets (COCO instances, ADE20K layout) for smoke tests and the demo.

The generator and its options are :mod:`visattn_mm.toy_data`; e.g.::

    python tools/make_toy_data.py coco data/toy_coco [--seed 0] [--num-train 200]
    python tools/make_toy_data.py ade20k data/toy_ade [--seed 0]
"""

from visattn_mm.toy_data import main

if __name__ == '__main__':
    main()
