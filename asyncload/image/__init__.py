"""The image path: stored bytes → pixels in the batch (``decode``, ``codecs``), the paired augmentation
(``augment``), the same on a GPU (``gpu``) and object-store files decoded one by one (``files``).
See README.md here for a sample's journey through it."""
